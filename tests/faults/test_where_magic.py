"""%dist_where and %%on_all_ranks --timeout in a real IPython shell (3 real ranks)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbdist.driver.runner import CellTimeout
from nbdist.errors import RankError


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    result = sh.run_cell("%dist_start 3 --timeout 120 --cpu")
    assert result.success, result.error_in_exec
    yield sh
    sh.run_line_magic("dist_stop", "")
    # The shell is a process-wide singleton: leave it as a fresh one for later test modules.
    sh.magics_manager.registry["DistMagics"].session = None


def test_dist_where_names_the_rank_that_never_entered(shell, capsys):
    result = shell.run_cell(
        "%%on_all_ranks --noblock\nimport time\nif rank == 1:\n    time.sleep(60)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    run = result.result
    try:
        text = ""
        for _ in range(200):  # until rank 0 waits in its all_reduce
            capsys.readouterr()
            shell.run_line_magic("dist_where", "")
            text = capsys.readouterr().out
            if "ranks 0,2: inside all_reduce" in text and "time.sleep(60)" in text:
                break
        lines = text.splitlines()
        # The odd one out first; ranks 0 and 2, the same diagnosis and stack, once.
        assert lines[0] == "rank 1: never entered all_reduce #1 (last: none yet)"
        assert "time.sleep(60)" in lines[1]
        assert "ranks 0,2: inside all_reduce #1 for " in text
        assert sum("dist.all_reduce(torch.ones(1))" in line for line in lines) == 1
        # The flight recorder numbers the same call #1 (nbdist's start-up check left out).
        assert "  ranks 0,2: #1 all_reduce [1]" in lines
        assert "  rank 1 is behind: no collective yet, another rank's last is #1" in lines
        assert not run.done()  # nothing was stopped
        shell.run_line_magic("dist_where", "--ranks 1")
        only = capsys.readouterr().out
        assert only.startswith("rank 1: ") and "rank 0" not in only
    finally:
        shell.magics_manager.registry["DistMagics"].session.interrupt([1])
        with pytest.raises(RankError):
            run.wait()


def test_dist_where_shows_the_flight_recorder_of_a_ddp_hang(shell, capsys):
    """A hang inside DDP's backward: the all-reduce is issued from C++, which only the
    process group's flight recorder sees; the report names the rank that is behind."""
    shell.run_cell(
        "%%on_all_ranks\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(4, 2))\n"
    )
    result = shell.run_cell(
        "%%on_all_ranks --noblock\nimport time\nloss = ddp(torch.ones(3, 4)).sum()\n"
        "if rank == 1:\n    time.sleep(60)\nloss.backward()\n"
    )
    run = result.result
    try:
        text = ""
        for _ in range(200):  # until rank 0 has issued its gradient all-reduce
            capsys.readouterr()
            shell.run_line_magic("dist_where", "")
            text = capsys.readouterr().out
            if "rank 1 is behind" in text:
                break
        assert "flight recorder (the process group's last collectives" in text
        # The bucket: Linear(4, 2)'s 8 weights and 2 biases, reduced as one flat tensor.
        rank0 = next(line for line in text.splitlines() if line.startswith("  ranks 0,2: #"))
        assert rank0.rstrip().endswith("all_reduce [10]")
        assert "rank 1 is behind: its last collective is #" in text
    finally:
        shell.magics_manager.registry["DistMagics"].session.interrupt([1])
        with pytest.raises(RankError):
            run.wait()


def test_dist_where_says_what_a_rank_that_cannot_answer_is_doing(shell, capsys):
    # Stopped (SIGSTOP), rank 2 answers nothing: the report reads its state from the process
    # table, where it said "(dead, or native code holding the GIL)", and does not wait 3 s
    # for an answer that cannot come.
    session = shell.magics_manager.registry["DistMagics"].session
    pid = session.ranks[2].pid
    capsys.readouterr()
    os.kill(pid, signal.SIGSTOP)
    try:
        # The signal takes effect once the rank is next scheduled: on a loaded machine,
        # after the report had read it "sleeping" and asked it (CI, 2026-12-07).
        deadline = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, psutil.Process(pid).status()
            time.sleep(0.01)
        shell.run_line_magic("dist_where", "")
        text = capsys.readouterr().out
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (
        "rank 2: not asked: its process is stopped (SIGSTOP, or Ctrl-Z in its terminal)\n" in text
    ), text
    shell.run_line_magic("dist_where", "")  # continued, it answers again
    again = capsys.readouterr().out
    assert "not asked" not in again and "no answer" not in again, again


def test_dist_where_bad_input(shell):
    with pytest.raises(UsageError, match="rank 7 does not exist: this cluster has ranks 0..2"):
        shell.run_line_magic("dist_where", "--ranks 7")


def test_timeout_shows_where_and_the_next_cell_works(shell, capsys):
    result = shell.run_cell(
        "%%on_all_ranks --timeout 2\nimport time\nif rank == 0:\n    time.sleep(60)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    assert isinstance(result.error_in_exec, CellTimeout)
    text = str(result.error_in_exec)
    assert "where the ranks were:" in text
    assert "rank 0: never entered all_reduce #" in text
    assert "ranks 1-2: inside all_reduce #" in text  # one line for both
    # What the user sees: the error first, no nbdist frames; they are one magic away.
    shown = capsys.readouterr().out
    first = next(line for line in shown.splitlines() if line.strip())
    assert first.startswith("CellTimeout: the cell ran longer than --timeout 2 s"), shown
    assert "nbdist/driver/runner.py" not in shown and "nbdist/magics/" not in shown
    assert "%dist_last_error --full shows the whole traceback" in shown
    # The wrapper nbdist puts around each collective is not part of the user's stack.
    assert "nbdist/engine/collectives.py" not in shown
    shell.run_line_magic("dist_last_error", "--full")
    full = capsys.readouterr().out
    assert "nbdist/driver/runner.py" in full and "CellTimeout: the cell ran longer" in full
    result = shell.run_cell("%%on_all_ranks\nt = torch.ones(1)\ndist.all_reduce(t)\nprint(t)")
    assert result.success, result.error_in_exec
    assert "[ranks 0-2] tensor([3.])" in capsys.readouterr().out
