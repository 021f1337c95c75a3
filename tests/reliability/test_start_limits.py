"""Limits met at many ranks, in a real kernel: checked before anything starts, or raised.

A kernel whose open-files limit cannot hold 256 ranks gets an error naming the
need, the limit and the fix, and nothing is started; a kernel whose soft limit
is low but whose hard limit allows more starts anyway (the soft limit is
raised, and the start line says so). The 256-rank start/all_reduce/print/stop
in a real kernel runs in the suite (about 2¼ minutes on 2 cores, ~7.4 GiB); it
is skipped, saying why, with less than 9 GiB free or ``NBDIST_TEST_256=0``.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest

from tests.conftest import wait_gone

LOWER_LIMIT = "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"


def _settled(proc: psutil.Process, fds: int, timeout: float = 10.0) -> int:
    """The kernel's open files once a stop's last threads have closed theirs (back to ``fds``)."""
    deadline = time.monotonic() + timeout
    while proc.num_fds() > fds + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    return proc.num_fds()


def test_a_kernel_whose_open_files_cannot_hold_256_ranks_is_told_why_and_nothing_starts(kernels):
    kernel = kernels()
    kernel.ok(LOWER_LIMIT.format(soft=300, hard=300) + "%load_ext nbdist")
    proc = psutil.Process(kernel.pid)
    fds = proc.num_fds()

    result = kernel.execute("%dist_start 256 --cpu", timeout=60)

    assert result.status == "error"
    text = result.error_text()
    assert re.search(r"256 ranks need about \d+ open files per process", text), text
    assert "the limit is 300 (hard limit, `ulimit -Hn`)" in text
    assert "`ulimit -n 1024`" in text and "Nothing was started." in text
    assert proc.children(recursive=True) == []
    assert _settled(proc, fds) <= fds + 2


def test_a_low_soft_open_files_limit_is_raised_for_the_start(kernels):
    kernel = kernels()
    # 16 ranks need the kernel's own files plus ~100: 64 would fail without the raise.
    kernel.ok(LOWER_LIMIT.format(soft=64, hard="resource.getrlimit(resource.RLIMIT_NOFILE)[1]"))
    kernel.ok("%load_ext nbdist")
    result = kernel.ok("%dist_start 16 --cpu --threads 1", timeout=300)
    assert "nbdist: 16 ranks ready" in result.stdout
    assert re.search(r"open-files limit raised from 64 to \d+ for 16 ranks", result.stdout)
    out = kernel.ok(
        "%%on_all_ranks\nt = torch.ones(1); torch.distributed.all_reduce(t); print('sum', int(t))"
    ).stdout
    assert "[ranks 0-15] sum 16" in out, out
    kernel.ok("%dist_stop")


def _why_not_256() -> str | None:
    if os.environ.get("NBDIST_TEST_256") == "0":
        return "NBDIST_TEST_256=0 leaves out the 256-rank run"
    free_gib = psutil.virtual_memory().available / 2**30
    if free_gib < 9:
        # ~7.4 GiB for the ranks (bench/RESULTS.md) plus the kernel and the controller.
        return f"256 CPU ranks need about 9 GiB of free memory; this machine has {free_gib:.1f} GiB"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_why_not_256() is not None, reason=str(_why_not_256()))
def test_256_ranks_start_all_reduce_print_and_stop_leaving_nothing(kernels, tmp_path):
    kernel = kernels()
    kernel.ok("%load_ext nbdist")
    proc = psutil.Process(kernel.pid)
    # What a first start leaves for good (imports, zmq's context): a 2-rank cycle pays it.
    kernel.ok("%dist_start 2 --cpu", timeout=300)
    kernel.ok("%dist_stop")
    time.sleep(3)
    before = {"fds": proc.num_fds(), "threads": proc.num_threads()}

    result = kernel.ok("%dist_start 256 --cpu --threads 1", timeout=600)
    assert "nbdist: 256 ranks ready" in result.stdout
    pids = kernel.nbdist_pids()
    assert len(pids) >= 256

    out = kernel.ok(
        "%%on_all_ranks\nt = torch.ones(1); torch.distributed.all_reduce(t); print('sum', int(t))",
        timeout=300,
    ).stdout
    assert out.strip().splitlines() == ["[ranks 0-255] sum 256"], out

    # %dist_sync: one machine, so one rank writes the copy and all 256 import from it.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.py").write_text("VALUE = 256\n")
    copies = tmp_path / "copies"
    kernel.ok(f"import os; os.chdir({str(tmp_path)!r})")
    kernel.ok(
        f"%%on_all_ranks\nimport os; os.environ['NBDIST_SYNC_DIR'] = {str(copies)!r}",
        timeout=300,
    )
    out = kernel.ok("%dist_sync src --copy", timeout=300).stdout
    assert "synced src/ (1 file, 12 B) to 1 machine: 1 holds a copy (1 file sent, 12 B)" in out, out
    out = kernel.ok("%%on_all_ranks\nimport model; print(model.VALUE)", timeout=300).stdout
    assert out.strip().splitlines() == ["[ranks 0-255] 256"], out

    kernel.ok("%dist_stop", timeout=120)
    assert wait_gone(pids, timeout=30) == []
    assert list((copies / f"nbdist-sync-{os.getuid()}").iterdir()) == [], (
        "the stop removed the copies"
    )
    assert proc.children(recursive=True) == []
    assert _settled(proc, before["fds"]) <= before["fds"] + 2
    deadline = time.monotonic() + 10
    while proc.num_threads() > before["threads"] + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.num_threads() <= before["threads"] + 2
