"""Separate process (run by scripts/gpu_check.sh): plan, run in parallel and report the GPU check's steps.

Standard library only, so ``--dry-run`` works with any Python 3.10+. The steps:

- ``pytest tests/gpu`` in shards (one per test file; the strategies files once per
  layout), each its own pytest process, so they run side by side on one GPU;
- every ``examples/NN_*.ipynb`` through scripts/run_notebook.py;
- the benchmarks (nccl --quick, train, log_call --cuda; shared_gpu and log_cost on request), run
  last and alone, as timing is their point, with the test files in ``ALONE``.

Jobs start longest first while the ranks they start fit (``--slots``, default two
per core, one slot per rank plus one for the kernel or pytest process) and the time budget
(``--budget``: a job that could not finish before it is not started and is reported
as such). Each job runs in a session of its own under its own limit (SIGINT, then
SIGKILL 30 s later); processes left with its token in their environment are
stopped by PID afterwards. ``results.json`` records every job (status, seconds,
the failing cell or tests, the exception, the log's last lines); ``--previous``
reads an earlier one so ``--only-failed`` re-runs only what did not pass (for a
pytest shard, only its failed tests) and ``--since COMMIT`` adds the jobs whose
own files changed since that commit.

Commands: ``plan`` (print the jobs, one a line: what --dry-run shows), ``run``
(run them, write results.json and results-table.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "Job",
    "main",
    "merge_results",
    "missing_imports",
    "notebook_failure",
    "plan_jobs",
    "pytest_failures",
    "render_table",
    "run_jobs",
    "select",
    "summary_line",
]

STEPS = ("tests", "notebooks", "nccl", "train", "shared", "log", "logcost")
# What a check runs unless --steps says otherwise. bench/shared_gpu.py (every collective on
# CUDA tensors over gloo, timed) only on request: tests/gpu checks those collectives, and its
# 90 s keep the tests and notebooks within the ten minutes. bench/log_cost.py (which part of
# nbdist.log costs a GPU step its time, with a profile) only on request too: ~3 minutes.
DEFAULT_STEPS = ("tests", "notebooks", "nccl", "train", "log")
# Seconds from the first job's start to the last one's end (gpu_check.sh --budget): with the
# install and start-up, the check fits ten minutes.
DEFAULT_BUDGET_S = 540
BENCHES = {
    "nccl": "nccl",
    "train": "train",
    "shared": "shared_gpu",
    "log": "log_call",
    "logcost": "log_cost",
}
# Each benchmark's arguments here. train.py: 9 windows of 1000 steps per job, taking turns,
# with the A/A control (4 jobs): run 3's --quick (3 windows of 300 steps, no control) gave
# nbdist 0.81x torchrun where run 1's gave 1.08x, too few steps to settle the ratio; at
# ~650 steps/s on an H200 this adds about a minute.
# log_call.py --cuda: what one nbdist.log call and one flush cost with the loss on the GPU
# (the parts of train.py's logging cost, measured apart). nccl.py: --quick's sizes, rounds
# added for 90 s at most (its start included) until the goal's ratio is settled: its two
# rounds alone gave 0.83x, 0.90x and 0.98x on three GPU runs of 2026-11-29/30.
BENCH_ARGS = {
    "nccl": ["--quick", "--settle", "2", "--max-minutes", "1.5"],
    "train": ["--windows", "9"],
    "shared_gpu": [],
    "log_call": ["--cuda", "--flushes", "--rounds", "5"],
    "log_cost": ["--profile"],
}
# Expected seconds on one H200 with 16 cores: the order jobs start in (longest first) and
# whether one still fits the budget. From the 2026-11-29 runs, rounded up: pytest shards
# 24-80 s with ten side by side, notebooks 23-65 s with five at once (the longest: a
# notebook started with less time left would be killed, not reported as not run),
# train.py 116 s, nccl.py 22 s, log_call.py 12 s, test_gpu_stats.py 26-28 s. (The earlier
# 240 s a shard, with a 540 s budget less the benchmarks' share, left no shard time to start.)
EXPECTED_S = {
    "pytest": 90,
    "notebook": 70,
    "bench": 30,
    "bench/train.py": 120,
    "bench/nccl.py": 105,
    "bench/log_call.py": 20,
    "bench/log_cost.py": 200,
    "tests/gpu/test_gpu_stats.py": 35,
}
# Test files that run by themselves, after the rest, as the benchmarks do:
# test_gpu_stats.py watches the whole GPU's memory in use (NVML) grow by the 1 GiB its rank
# allocates and shrink back, which other jobs' allocations on the same GPU would blur.
ALONE = {"test_gpu_stats.py"}
# Ranks a notebook starts (its %dist_start), where not 2.
NOTEBOOK_RANKS = {"18": 4, "26": 8, "27": 4}
# tests/gpu files split by layout (their ``one_gpu`` parametrisation ids).
LAYOUT_SPLIT = {
    "test_strategies_gpu.py": ("gloo2", "nccl1"),
    "test_integrations_gpu.py": ("gloo2", "nccl1"),
}
TAIL_LINES = 15


@dataclass
class Job:
    """One step: a command, where it runs, its log, and what it reported."""

    name: str
    kind: str  # "pytest", "notebook" or "bench"
    command: list[str]
    files: list[str]  # the checkout's files this step exercises directly (for --since)
    slots: int = 3
    limit_s: int = 600
    expected_s: int = 60
    alone: bool = False  # runs by itself after the side-by-side phase (benchmarks, ALONE)
    status: str = "not run"  # pass, fail (exit N), timeout, skip, not run (...)
    seconds: float = 0.0
    log: str = ""
    error: str = ""  # the failing cell and exception, or the failed tests
    failed_tests: list[str] = field(default_factory=list)
    summary: str = ""  # pytest's last line ("40 passed, 2 skipped in 61s"), a notebook's OK line
    tail: str = ""


# -- parsing a step's log -------------------------------------------------------------------


def notebook_failure(log: str) -> str:
    """run_notebook.py's ``FAILED: code cell N (...) raised Exc: msg`` line, or ''."""
    lines = [x for x in log.splitlines() if x.startswith("FAILED: ")]
    return lines[-1][len("FAILED: ") :].strip() if lines else ""


_PYTEST_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+?)(?: - (.*))?$")


def pytest_failures(log: str) -> list[tuple[str, str]]:
    """[(node id, its one-line reason)] from pytest's short summary (``-rfE``)."""
    found = []
    for line in log.splitlines():
        m = _PYTEST_SUMMARY.match(line.strip())
        if m and "::" in m.group(2):
            found.append((m.group(2), (m.group(3) or m.group(1)).strip()))
    return found


_PYTEST_TOTALS = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected)\b|no tests ran")


def summary_line(log: str) -> str:
    """pytest's closing counts, or run_notebook.py's OK line ('' when neither is there)."""
    for line in reversed(log.splitlines()):
        text = line.strip().strip("=").strip()
        if _PYTEST_TOTALS.search(text) or text.startswith("OK: "):
            return text
    return ""


def _tail(log: str, n: int = TAIL_LINES) -> str:
    return "\n".join(log.rstrip("\n").splitlines()[-n:])


# -- planning -------------------------------------------------------------------------------


def _pytest_jobs(root: Path, python: str, outdir: Path, limit: int | None) -> list[Job]:
    jobs = []
    for path in sorted((root / "tests" / "gpu").glob("test_*.py")):
        rel = str(path.relative_to(root))
        shards = LAYOUT_SPLIT.get(path.name, (None,))
        for layout in shards:
            name = f"pytest {rel}" + (f" [{layout}]" if layout else "")
            tag = path.stem + (f"-{layout}" if layout else "")
            command = [python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", rel]
            command += ["--junitxml", str(outdir / f"pytest-{tag}.xml")]
            if layout:
                command += ["-k", layout if layout == shards[0] else f"not {shards[0]}"]
            files = [rel, "tests/gpu/conftest.py"]
            alone = path.name in ALONE
            jobs.append(
                Job(
                    name,
                    "pytest",
                    command,
                    files,
                    slots=16 if alone else 5,
                    limit_s=limit or 540,
                    expected_s=EXPECTED_S.get(rel, EXPECTED_S["pytest"]),
                    alone=alone,
                )
            )
    return jobs


def plan_jobs(
    root: Path,
    *,
    python: str = sys.executable,
    steps: tuple[str, ...] = DEFAULT_STEPS,
    examples: str = "[0-9][0-9]_*",
    limit: int | None = None,
    outdir: Path | None = None,
) -> list[Job]:
    """Every job the steps ask for, in the order they are listed (not yet run)."""
    outdir = outdir or root / "gpu_check_out"
    jobs: list[Job] = []
    if "tests" in steps:
        jobs += _pytest_jobs(root, python, outdir, limit)
    if "notebooks" in steps:
        seen = []
        for pattern in examples.split(","):
            for nb in sorted((root / "examples").glob(f"{pattern}.ipynb")):
                if nb not in seen:
                    seen.append(nb)
        for nb in seen:
            rel = str(nb.relative_to(root))
            ranks = NOTEBOOK_RANKS.get(nb.name[:2], 2)
            command = [python, str(root / "scripts" / "run_notebook.py"), str(nb)]
            jobs.append(
                Job(
                    rel,
                    "notebook",
                    command,
                    [rel],
                    slots=ranks + 1,
                    limit_s=limit or 420,
                    expected_s=EXPECTED_S["notebook"],
                )
            )
        if not seen:
            jobs.append(
                Job(
                    f"examples/{examples}.ipynb",
                    "notebook",
                    [],
                    [],
                    status="fail (no such notebook)",
                )
            )
    for step, bench in BENCHES.items():
        if step in steps:
            rel = f"bench/{bench}.py"
            command = [python, rel, *BENCH_ARGS[bench]]
            job = Job(
                f"python {' '.join(command[1:])}",
                "bench",
                command,
                [rel],
                slots=16,
                limit_s=limit or 240,
                expected_s=EXPECTED_S.get(rel, EXPECTED_S["bench"]),
                alone=True,
            )
            if not (root / rel).is_file():
                job.status = "skip"
                job.error = f"{rel} is not in this checkout"
            jobs.append(job)
    return jobs


def missing_imports(notebook: Path) -> list[str]:
    """Top-level modules a code cell imports (unguarded, at the line's start) that this
    Python cannot find."""
    import importlib.util

    names = set()
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] == "code":
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"(?:from|import)\s+([A-Za-z_]\w*)", line)
                if m:
                    names.add(m.group(1))
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def merge_results(previous: dict | None, jobs: list[Job]) -> dict:
    """``previous`` with the jobs run now replacing theirs (so --only-failed can go on)."""
    merged = {j["name"]: j for j in (previous or {}).get("jobs", [])}
    for job in jobs:
        merged[job.name] = asdict(job)
    return {"jobs": list(merged.values())}


def select(jobs: list[Job], previous: dict | None, *, only_failed: bool, changed: set[str]):
    """The jobs to run now: with ``only_failed`` those that did not pass in ``previous``
    (a pytest shard narrowed to its failed tests), plus those whose files are in ``changed``."""
    if not only_failed and not changed:
        return jobs
    before = {j["name"]: j for j in (previous or {}).get("jobs", [])}
    chosen = []
    for job in jobs:
        own_change = any(f in changed for f in job.files)
        last = before.get(job.name)
        failed = last is not None and last["status"] not in ("pass", "skip")
        if not (failed or own_change):
            continue
        if failed and not own_change and job.kind == "pytest" and last.get("failed_tests"):
            # Only the tests that failed (node ids replace the file and -k).
            keep = [a for a in job.command if not a.endswith(".py")]
            if "-k" in keep:
                i = keep.index("-k")
                del keep[i : i + 2]
            job.command = keep + last["failed_tests"]
        chosen.append(job)
    return chosen


def expect_from(jobs: list[Job], previous: dict | None) -> None:
    """Each job's expected seconds from what it took in ``previous`` (its own time, a quarter
    more and 5 s), where it ran to its end there: the table's figure is the longest of a
    kind, and most jobs take less, so more of them start within the budget."""
    before = {j["name"]: j for j in (previous or {}).get("jobs", [])}
    for job in jobs:
        last = before.get(job.name)
        if not last or not str(last.get("status", "")).startswith(("pass", "fail")):
            continue  # not run, skipped, or a timeout: its time says nothing
        seconds = last.get("seconds")
        if isinstance(seconds, (int, float)) and seconds > 0:
            job.expected_s = int(seconds * 1.25) + 5


def changed_since(root: Path, commit: str) -> set[str]:
    """Files changed between ``commit`` and the working tree (tracked and untracked)."""
    diff = subprocess.run(
        ["git", "-C", str(root), "diff", "--name-only", commit],
        capture_output=True,
        text=True,
        check=False,
    )
    if diff.returncode != 0:
        raise SystemExit(f"gpu_check: --since {commit!r}: git diff failed: {diff.stderr.strip()}")
    new = subprocess.run(
        ["git", "-C", str(root), "ls-files", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        check=False,
    )
    return set(diff.stdout.split()) | set(new.stdout.split())


# -- running ----------------------------------------------------------------------------------


def _token_pids(token: str) -> list[int]:
    needle = f"NBDIST_GPU_CHECK_STEP={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def _stop_leftovers(token: str) -> list[int]:
    """Processes still carrying the job's token: TERM, then KILL 10 s later. Their PIDs."""
    left = _token_pids(token)
    if not left:
        return []
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
        for pid in _token_pids(token):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while _token_pids(token) and time.monotonic() < deadline:
            time.sleep(0.2)
    return left


def _finish(job: Job, proc, started: float, log_path: Path, timed_out: bool) -> None:
    job.seconds = round(time.monotonic() - started, 1)
    rc = proc.returncode
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    job.tail = _tail(text)
    job.summary = summary_line(text)
    if timed_out:
        job.status = f"timeout ({job.limit_s} s)"
    elif rc == 0:
        job.status = "pass"
    else:
        job.status = f"fail (exit {rc})"
    if job.kind == "notebook":
        job.error = notebook_failure(text)
    elif job.kind == "pytest":
        failures = pytest_failures(text)
        job.failed_tests = [node for node, _ in failures]
        job.error = "; ".join(f"{node}: {why}" for node, why in failures)[:3000]
        if rc == 5:  # pytest: nothing collected (a node id that no longer exists)
            job.error = job.error or "no tests ran"


def run_jobs(jobs: list[Job], root: Path, outdir: Path, *, slots: int, budget_s: float) -> None:
    """Run ``jobs`` (their status set already are left alone), at most ``slots`` in use."""
    logs = outdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (outdir / "notebooks").mkdir(exist_ok=True)
    t0 = time.monotonic()
    todo = [j for j in jobs if j.status == "not run" and not j.alone]
    todo.sort(key=lambda j: -j.expected_s)
    # Alone, in plan order: the ALONE test files, then the benchmarks.
    benches = [j for j in jobs if j.status == "not run" and j.alone]
    running: list[tuple[Job, subprocess.Popen, float, Path, str]] = []

    def start(job: Job, deadline: float) -> None:
        # No job outlives the budget: its limit is cut to what is left of it.
        job.limit_s = max(1, min(job.limit_s, int(deadline - time.monotonic())))
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", job.name).strip("_")
        log_path = logs / f"{safe}.log"
        job.log = str(log_path.relative_to(outdir))
        token = f"{os.getpid()}-{len(running)}-{time.monotonic_ns()}"
        env = dict(os.environ, NBDIST_GPU_CHECK_STEP=token)
        cwd = outdir / "notebooks" if job.kind == "notebook" else root
        print(f"== start {job.name} (limit {job.limit_s} s)", flush=True)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                job.command,
                cwd=cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        running.append((job, proc, time.monotonic(), log_path, token))

    def reap(block_until: float | None = None) -> None:
        while running:
            for item in list(running):
                job, proc, started, log_path, token = item
                over = time.monotonic() - started > job.limit_s
                if proc.poll() is None and not over:
                    continue
                timed_out = False
                if proc.poll() is None:
                    timed_out = True
                    os.killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                running.remove(item)
                _finish(job, proc, started, log_path, timed_out)
                left = _stop_leftovers(token)
                if left:
                    job.error = (job.error + f"; processes left behind, stopped: {left}").lstrip(
                        "; "
                    )
                print(f"== {job.status:<14} {job.name} ({job.seconds:.0f} s)", flush=True)
                if job.status != "pass":
                    line = job.error or job.tail.splitlines()[-1:] or [""]
                    print(f"   {line if isinstance(line, str) else line[0]}", flush=True)
            if block_until is None or time.monotonic() >= block_until or not running:
                return
            time.sleep(0.5)

    def in_use() -> int:
        return sum(j.slots for j, *_ in running)

    # The expected time of the jobs that run alone (the benchmarks) is kept for them: they
    # run after the rest.
    parallel_budget = budget_s - sum(j.expected_s for j in benches)
    while todo or running:
        reap()
        left_s = parallel_budget - (time.monotonic() - t0)
        for job in list(todo):
            if job.expected_s > left_s:
                job.status = "not run (time budget)"
                todo.remove(job)
            elif in_use() + job.slots <= slots or not running:
                todo.remove(job)
                start(job, t0 + parallel_budget)
        if running:
            time.sleep(0.5)
    for job in benches:
        if job.expected_s > budget_s - (time.monotonic() - t0):
            job.status = "not run (time budget)"
            continue
        start(job, t0 + budget_s)
        reap(block_until=float("inf"))


# -- reporting ---------------------------------------------------------------------------------


def render_table(jobs: list[Job]) -> str:
    """The markdown results table and, for each step that did not pass, its error and last lines."""
    lines = ["| step | result | time | notes |", "|---|---|---|---|"]
    for job in jobs:
        last = (job.tail.splitlines() or [""])[-1]
        note = job.error or job.summary or ("" if job.status == "pass" else last)
        note = note.replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {job.name} | {job.status} | {job.seconds:.0f} s | {note} |")
    for job in jobs:
        if job.status in ("pass", "skip") or job.status.startswith("not run"):
            continue
        lines += ["", f"**{job.name}**: {job.status}" + (f", log `{job.log}`" if job.log else "")]
        if job.error:
            lines += ["", f"error: {job.error}"]
        if job.tail:
            lines += ["", "```", job.tail, "```"]
    bench_out = [j for j in jobs if j.kind == "bench" and j.status == "pass" and j.tail]
    for job in bench_out:
        lines += ["", f"{job.name}, last lines:", "", "```", job.tail, "```"]
    return "\n".join(lines)


def _load(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    """``plan`` or ``run`` (see the module docstring); exit 1 when a job did not pass."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("plan", "run"))
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS))
    p.add_argument("--examples", default="[0-9][0-9]_*")
    p.add_argument("--timeout", type=int, default=None)
    # Two slots a core: a rank on a GPU mostly waits for it once started.
    p.add_argument("--slots", type=int, default=2 * (os.cpu_count() or 2))
    p.add_argument("--budget", type=float, default=float(DEFAULT_BUDGET_S))
    p.add_argument("--previous", type=Path, default=None)
    p.add_argument("--only-failed", action="store_true")
    p.add_argument("--since", default=None)
    a = p.parse_args(argv)
    out = a.out or a.root / "gpu_check_out"
    steps = tuple(s for s in a.steps.split(",") if s)
    jobs = plan_jobs(
        a.root, python=a.python, steps=steps, examples=a.examples, limit=a.timeout, outdir=out
    )
    previous = _load(a.previous)
    if a.only_failed and previous is None:
        raise SystemExit(
            f"gpu_check: --only-failed needs the results.json of an earlier run "
            f"(--previous FILE; {a.previous or 'none given'} does not exist)"
        )
    changed = changed_since(a.root, a.since) if a.since else set()
    jobs = select(jobs, previous, only_failed=a.only_failed or bool(a.since), changed=changed)
    expect_from(jobs, previous)
    if a.command == "plan":
        for job in jobs:
            state = "" if job.status == "not run" else f"  {job.status}: {job.error}"
            alone = ", alone after the rest" if job.alone else ""
            print(
                f"{job.kind:<8} {job.name}  [{job.slots} slots, limit {job.limit_s} s{alone}]{state}"
            )
            print(f"         $ {' '.join(job.command)}")
        print(f"{len(jobs)} jobs; {a.slots} slots; budget {a.budget:.0f} s")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    run_jobs(jobs, a.root, out, slots=a.slots, budget_s=a.budget)
    merged = merge_results(previous, jobs)
    (out / "results.json").write_text(json.dumps(merged, indent=1))
    (out / "results-table.md").write_text(render_table(jobs) + "\n")
    return 0 if all(j.status in ("pass", "skip") for j in jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
