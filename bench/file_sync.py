"""``%dist_sync`` against sending every file to every rank, on the same ranks, interleaved.

A project of small files (source-like: ``--files`` of 1-8 KiB, plus 4 of 256 KiB) is
made in a temporary folder; one session of ``--n`` CPU ranks (one machine). Three
situations, each timed for both paths in every repetition (alternating which goes
first):

- full:      a machine without a copy (the session's copies removed before each)
- one edit:  one file changed since the last sync
- unchanged: nothing changed

The baseline is what a notebook does without ``%dist_sync``: every rank receives
every file (``session.apply`` of a function that writes them) and writes its own
copy. ``sync_files(..., copy=True)`` stands in for machines without the files (on
this one every rank would otherwise see them in place). The figure is the ratio of
medians, sync / baseline (below 1: faster). One machine is the case that favours the
baseline least and most at once: its ranks share one copy (sent once, not n times),
but the controller's fan-out to n local engines is cheap.

Usage: python bench/file_sync.py [--n 8] [--files 400] [--reps 7] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import CpuMeter, assert_no_children, conclude, machine, median, ratio, run_benchmark  # noqa: E402

# The edit loop's goal: after an edit (or none) a re-sync costs less than sending everything.
GOAL = 1.0


def make_project(root: str, files: int) -> int:
    """Source-like files (1-8 KiB) in nested packages, and four 256 KiB ones; total bytes."""
    rng = random.Random(0)
    total = 0
    for i in range(files):
        rel = os.path.join(f"pkg{i % 10}", f"sub{i % 3}", f"mod{i}.py")
        data = bytes(rng.getrandbits(8) for _ in range(rng.randint(1024, 8192)))
        total += _write(os.path.join(root, rel), data)
    for i in range(4):
        total += _write(os.path.join(root, "assets", f"table{i}.bin"), os.urandom(256 << 10))
    return total


def _write(path: str, data: bytes) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def read_all(root: str) -> dict[str, bytes]:
    out = {}
    for here, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(here, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def write_on_rank(files: dict, folder: str) -> int:
    # On a rank: the baseline's copy, one per rank (nothing tells ranks of one machine apart).
    import os

    target = os.path.join(folder, f"rank-{os.getpid()}")
    for rel, data in files.items():
        path = os.path.join(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return len(files)


def measure(n: int, files: int, reps: int) -> dict:
    import nbdist
    from nbdist.driver import file_sync
    from nbdist.engine import synced_files

    work = tempfile.mkdtemp(prefix="nbdist-bench-sync-")
    project = os.path.join(work, "project")
    total = make_project(project, files)
    baseline_dir = os.path.join(work, "baseline")
    os.environ[synced_files.SYNC_DIR_ENV] = os.path.join(work, "copies")
    times: dict[str, dict[str, list[float]]] = {
        case: {"sync": [], "baseline": []} for case in ("full", "one edit", "unchanged")
    }
    edited = sorted(read_all(project))[0]
    try:
        with nbdist.DistSession(n, cpu=True, timeout=300) as session:
            print(
                f"  {n} ranks ready, project {files + 4} files, {total / 2**20:.1f} MiB", flush=True
            )

            def baseline():
                session.apply(write_on_rank, read_all(project), baseline_dir)

            def sync():
                file_sync.sync_files(session, [project], copy=True)

            def fresh():
                # A machine without a copy: the session's copies and its record of them gone.
                file_sync.session_stopping(session, session.client)
                file_sync._STATES.pop(session, None)  # noqa: SLF001 - a fresh start, for the bench
                shutil.rmtree(baseline_dir, ignore_errors=True)

            def edit():
                with open(os.path.join(project, edited), "ab") as f:
                    f.write(b"# edited\n")

            sync()  # warm-up: imports, first connections
            baseline()
            for i in range(reps):
                first, second = ("sync", "baseline") if i % 2 == 0 else ("baseline", "sync")
                for case in ("full", "one edit", "unchanged"):
                    for which in (first, second):
                        if case == "full":
                            fresh()
                            if which == second:  # the other path's copy in place meanwhile
                                (sync if second == "baseline" else baseline)()
                        elif case == "one edit":
                            edit()
                        t0 = time.perf_counter()
                        (sync if which == "sync" else baseline)()
                        times[case][which].append(time.perf_counter() - t0)
    finally:
        os.environ.pop(synced_files.SYNC_DIR_ENV, None)
        shutil.rmtree(work, ignore_errors=True)
    row = {"n": n, "files": files + 4, "bytes": total, "reps": reps}
    for case, pair in times.items():
        s, b = median(pair["sync"]), median(pair["baseline"])
        row[case] = {
            "sync_ms": round(s * 1e3, 1),
            "baseline_ms": round(b * 1e3, 1),
            "ratio": round(ratio(s, b), 3),
        }
    return row


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None, help="ranks (default 8)")
    parser.add_argument("--files", type=int, default=None, help="small files (default 400)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 7)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 ranks, 40 files, 2 reps")
    args = parser.parse_args(argv)
    n = args.n or (2 if args.quick else 8)
    files = args.files or (40 if args.quick else 400)
    reps = args.reps or (2 if args.quick else 7)

    info = machine()
    meter = CpuMeter()
    print(f"file_sync: n={n}, {files} small files, {reps} repetitions, {info}", flush=True)
    leftovers: list[int] = []
    try:
        row = measure(n, files, reps)
    finally:
        leftovers = assert_no_children()
        cpu = meter.read()
    print()
    print(f"{'case':<10} {'sync':>10} {'baseline':>10} {'ratio':>7}")
    for case in ("full", "one edit", "unchanged"):
        r = row[case]
        print(f"{case:<10} {r['sync_ms']:>8.1f}ms {r['baseline_ms']:>8.1f}ms {r['ratio']:>6.3f}x")
    ok = row["one edit"]["ratio"] <= GOAL and row["unchanged"]["ratio"] <= GOAL
    goal = f"a one-file or unchanged re-sync <= {GOAL}x sending every file"
    conclude("file_sync", goal, GOAL, ok, leftovers, cpu, info, args.quick, row=row)
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
