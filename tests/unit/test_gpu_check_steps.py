"""scripts/gpu_check_steps.py, the GPU check's planner and runner, without a GPU.

Its parsing of real pytest and run_notebook.py output, the choice of what --only-failed
and --since re-run, the results block, and the runner itself on small real commands
(a pass, a failure, a timeout, a process that escapes its job's session).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "gpu_check_steps", ROOT / "scripts/gpu_check_steps.py"
)
steps = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check_steps"] = steps  # dataclasses look their module up by name
_spec.loader.exec_module(steps)


def test_pytest_failures_read_from_a_real_pytest_run(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('no fixture')\n"
        "def test_error(broken):\n    pass\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "test_x.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    found = dict(steps.pytest_failures(out.stdout))
    assert steps.summary_line(out.stdout).startswith("1 failed, 1 passed, 1 error in ")
    assert set(found) == {"test_x.py::test_bad", "test_x.py::test_error"}, out.stdout
    assert "one is not two" in found["test_x.py::test_bad"]
    assert "no fixture" in found["test_x.py::test_error"]


def test_notebook_failure_is_run_notebooks_failed_line():
    log = (
        ">>> %dist_start 2\n...\nexecuted notebook written to artifacts/09_fsdp.ipynb\n"
        "FAILED: code cell 5 (['%%on_all_ranks', 'model = apply_fsdp(net, offload=True)']) "
        "raised RankError: rank 1: RuntimeError: CUDA error\n"
    )
    assert steps.notebook_failure(log) == (
        "code cell 5 (['%%on_all_ranks', 'model = apply_fsdp(net, offload=True)']) "
        "raised RankError: rank 1: RuntimeError: CUDA error"
    )
    assert steps.notebook_failure("OK: every cell ran\n") == ""
    assert steps.summary_line("x\nOK: every cell ran\n") == "OK: every cell ran"


def _previous(jobs, statuses: dict) -> dict:
    out = []
    for job in jobs:
        record = steps.asdict(job)
        record["status"] = statuses.get(job.name, "pass")
        if job.name == "pytest tests/gpu/test_strategies_gpu.py [gloo2]":
            record["failed_tests"] = ["tests/gpu/test_strategies_gpu.py::test_a[gloo2]"]
        out.append(record)
    return {"jobs": out}


def test_only_failed_reruns_what_did_not_pass_and_only_the_failed_tests():
    jobs = steps.plan_jobs(ROOT, python="PY")
    names = [j.name for j in jobs]
    assert "examples/09_fsdp.ipynb" in names and "python bench/train.py --windows 9" in names
    assert "pytest tests/gpu/test_strategies_gpu.py [nccl1]" in names
    previous = _previous(
        jobs,
        {
            "pytest tests/gpu/test_strategies_gpu.py [gloo2]": "fail (exit 1)",
            "examples/09_fsdp.ipynb": "timeout (420 s)",
            "examples/01_ddp_digits.ipynb": "skip",
        },
    )
    again = steps.select(
        steps.plan_jobs(ROOT, python="PY"), previous, only_failed=True, changed=set()
    )
    assert [j.name for j in again] == [
        "pytest tests/gpu/test_strategies_gpu.py [gloo2]",
        "examples/09_fsdp.ipynb",
    ]
    shard = again[0]
    assert shard.command[-1] == "tests/gpu/test_strategies_gpu.py::test_a[gloo2]"
    assert "-k" not in shard.command and "tests/gpu/test_strategies_gpu.py" not in shard.command
    # --since adds the jobs whose own files changed, whole.
    since = steps.select(
        steps.plan_jobs(ROOT, python="PY"),
        previous,
        only_failed=True,
        changed={"examples/12_pipeline_parallel.ipynb", "tests/gpu/conftest.py"},
    )
    names = [j.name for j in since]
    assert "examples/12_pipeline_parallel.ipynb" in names
    assert all(j.name in names for j in jobs if j.kind == "pytest")  # conftest: every shard
    assert "examples/00_quickstart.ipynb" not in names
    # The merged results keep what passed before for the next --only-failed.
    merged = steps.merge_results(previous, again)
    assert len(merged["jobs"]) == len(jobs)


def test_the_results_block_names_the_failing_cell_exception_and_last_lines():
    job = steps.Job("examples/09_fsdp.ipynb", "notebook", ["x"], [], status="fail (exit 1)")
    job.error = "code cell 5 (['%%on_all_ranks']) raised RankError: rank 1: CUDA error"
    job.tail = "line a\nline b\nFAILED: code cell 5 ..."
    job.log = "logs/examples_09_fsdp.ipynb.log"
    ok = steps.Job("examples/00_quickstart.ipynb", "notebook", ["x"], [], status="pass", seconds=12)
    text = steps.render_table([ok, job])
    assert "| examples/00_quickstart.ipynb | pass | 12 s |  |" in text
    assert "| examples/09_fsdp.ipynb | fail (exit 1) | 0 s | code cell 5" in text
    assert "error: code cell 5 (['%%on_all_ranks']) raised RankError: rank 1: CUDA error" in text
    assert "line a\nline b\nFAILED: code cell 5 ..." in text
    assert "logs/examples_09_fsdp.ipynb.log" in text


def _gone(pid: int) -> bool:
    """Exited (a zombie awaiting its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_the_runner_runs_side_by_side_and_records_pass_fail_timeout_and_leftovers(tmp_path):
    py = sys.executable
    pidfile = tmp_path / "escaped.pid"
    escape = (
        "import subprocess, sys\n"
        "p = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
    )
    jobs = [
        steps.Job("ok", "notebook", [py, "-c", "print('fine')"], [], slots=1, limit_s=60),
        steps.Job(
            "bad",
            "notebook",
            [
                py,
                "-c",
                "import sys; print('FAILED: code cell 1 ([]) raised ValueError: x', file=sys.stderr); sys.exit(1)",
            ],
            [],
            slots=1,
            limit_s=60,
        ),
        steps.Job(
            "slow", "notebook", [py, "-c", "import time; time.sleep(60)"], [], slots=1, limit_s=2
        ),
        steps.Job("escapes", "notebook", [py, "-c", escape], [], slots=1, limit_s=60),
    ]
    started = time.monotonic()
    steps.run_jobs(jobs, tmp_path, tmp_path / "out", slots=4, budget_s=120)
    # Side by side, the slow one stopped at its limit: far less than its 60 s of sleep.
    assert time.monotonic() - started < 50
    by = {j.name: j for j in jobs}
    assert by["ok"].status == "pass" and by["ok"].tail == "fine"
    assert by["bad"].status == "fail (exit 1)"
    assert by["bad"].error == "code cell 1 ([]) raised ValueError: x"
    assert by["slow"].status == "timeout (2 s)"
    # A budget shorter than a job's limit cuts the limit: no job outlives the budget.
    late = steps.Job("late", "notebook", [py, "-c", "import time; time.sleep(60)"], [], limit_s=600)
    late.expected_s = 1
    steps.run_jobs([late], tmp_path, tmp_path / "out2", slots=4, budget_s=3)
    assert late.status.startswith("timeout (") and late.seconds < 30, (late.status, late.seconds)
    escaped = int(pidfile.read_text())
    assert "processes left behind, stopped" in by["escapes"].error
    deadline = time.monotonic() + 10
    while not _gone(escaped) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(escaped), f"the escaped process {escaped} is still alive"
    assert (tmp_path / "out" / by["ok"].log).read_text().strip() == "fine"


def test_dry_run_lists_the_jobs_without_a_wheelhouse_and_only_failed_needs_results(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, NBDIST_GPU_CHECK_OUT=str(tmp_path / "o"))
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--examples", "0[09]_*"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "pytest tests/gpu/test_strategies_gpu.py [gloo2]" in run.stdout
    assert "examples/09_fsdp.ipynb" in run.stdout and "examples/12_" not in run.stdout
    assert "bench/train.py --windows 9" in run.stdout
    assert "bench/log_call.py --cuda --flushes" in run.stdout
    assert not (tmp_path / "o").exists()
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--only-failed"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode != 0 and "--only-failed needs the results.json" in run.stderr
    results = tmp_path / "results.json"
    results.write_text(
        json.dumps({"jobs": [{"name": "examples/09_fsdp.ipynb", "status": "fail (exit 1)"}]})
    )
    run = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts/gpu_check.sh"),
            "--dry-run",
            "--only-failed",
            "--previous",
            str(results),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "examples/09_fsdp.ipynb" in run.stdout and "1 jobs" in run.stdout


def test_the_default_check_leaves_every_job_room_in_the_default_budget():
    """With the default steps and budget (540 s), the expected time of the jobs that run alone
    (the benchmarks and test_gpu_stats.py, kept for them after the rest) leaves the longest test or notebook job room to start: none is planned
    to be skipped for time before anything ran."""
    jobs = steps.plan_jobs(ROOT, python="PY")
    benches = [j for j in jobs if j.alone]
    rest = [j for j in jobs if not j.alone]
    assert {j.name.split(" [")[0] for j in benches} == {
        "pytest tests/gpu/test_gpu_stats.py",
        "python bench/nccl.py --quick --settle 2 --max-minutes 1.5",
        "python bench/train.py --windows 9",
        "python bench/log_call.py --cuda --flushes --rounds 5",
    }
    parallel_budget = steps.DEFAULT_BUDGET_S - sum(j.expected_s for j in benches)
    assert max(j.expected_s for j in rest) <= parallel_budget, (
        parallel_budget,
        [(j.name, j.expected_s) for j in benches],
    )


def test_a_job_that_runs_alone_starts_after_the_side_by_side_ones_end(tmp_path):
    """test_gpu_stats.py (and each benchmark) runs with nothing else on the GPU."""
    py = sys.executable
    stamp = "import sys, time; print(sys.argv[1], time.time()); time.sleep(float(sys.argv[2]))"
    jobs = [
        steps.Job("alone", "pytest", [py, "-c", stamp, "alone", "0"], [], slots=1, alone=True),
        steps.Job("a", "notebook", [py, "-c", stamp, "a", "3"], [], slots=1),
        steps.Job("b", "notebook", [py, "-c", stamp, "b", "3"], [], slots=1),
    ]
    for job in jobs:
        job.expected_s = 5
    steps.run_jobs(jobs, tmp_path, tmp_path / "out", slots=4, budget_s=60)
    assert [j.status for j in jobs] == ["pass"] * 3
    t = {j.name: float(j.tail.split()[-1]) for j in jobs}
    # a and b side by side (both started before either ended), the alone job after both.
    assert abs(t["a"] - t["b"]) < 3, t
    assert t["alone"] >= max(t["a"], t["b"]) + 3 - 0.2, t


def test_expected_times_come_from_the_previous_run_where_a_job_ran_to_its_end():
    jobs = steps.plan_jobs(ROOT, python="PY")
    by_name = {j.name: j for j in jobs}
    table = by_name["examples/00_quickstart.ipynb"].expected_s
    previous = {
        "jobs": [
            {"name": "examples/00_quickstart.ipynb", "status": "pass", "seconds": 29.4},
            {"name": "examples/09_fsdp.ipynb", "status": "fail (exit 1)", "seconds": 44.0},
            {"name": "examples/01_ddp_digits.ipynb", "status": "timeout", "seconds": 420.0},
            {"name": "examples/02_dataparallel.ipynb", "status": "not run (time budget)"},
        ]
    }
    steps.expect_from(jobs, previous)
    assert by_name["examples/00_quickstart.ipynb"].expected_s == int(29.4 * 1.25) + 5 == 41
    assert by_name["examples/09_fsdp.ipynb"].expected_s == 60
    # A timeout or a job that did not run keeps the table's figure.
    assert by_name["examples/01_ddp_digits.ipynb"].expected_s == table
    assert by_name["examples/02_dataparallel.ipynb"].expected_s == table


def test_the_logging_cost_benchmark_runs_only_when_asked_and_alone():
    """bench/log_cost.py (which part of nbdist.log costs a GPU step, with a profile) is a
    step of its own, left out of the default check, and refused steps are named."""
    default = [j.name for j in steps.plan_jobs(ROOT, python="PY")]
    assert not any("log_cost" in name for name in default)
    asked = steps.plan_jobs(ROOT, python="PY", steps=("logcost",))
    assert [(j.name, j.alone) for j in asked] == [("python bench/log_cost.py --profile", True)]
    env = dict(os.environ, PYTHON=sys.executable)
    run = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", "--steps", "logcost,logcosts"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode != 0 and "unknown step 'logcosts'" in run.stderr
