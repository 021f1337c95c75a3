"""nbdist inside a real Jupyter kernel: failing ranks, interrupts, and nothing left after the kernel goes.

Kernels are started from the ``python3`` kernel spec with jupyter_client, as a
notebook server would; see ``conftest.py`` for the :class:`Kernel` wrapper.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import psutil
import pytest

from tests.conftest import wait_gone

_LABELLED = re.compile(r"^\[ranks? ([\d,\-]+)\] ?(.*)$")


def _expand(ranks: str) -> set[int]:
    out: set[int] = set()
    for part in ranks.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def ranks_printed(stdout: str, text: str) -> set[int]:
    """The ranks whose labelled output has the line ``text`` ("[ranks 0-1] x" or "[rank 0] x")."""
    ranks: set[int] = set()
    for line in stdout.splitlines():
        match = _LABELLED.match(line)
        if match and match.group(2) == text:
            ranks |= _expand(match.group(1))
    return ranks


def shown_text(outputs: list[dict]) -> str:
    """What the cell has shown so far: its stream text and its displays' text, live ones too.

    While a cell runs, several ranks' lines are one display redrawn in place
    (``update_display_data``); when it ends they are the cell's stream output.
    """
    parts = []
    for m in outputs:
        if m["msg_type"] == "stream":
            parts.append(m["content"]["text"])
        elif m["msg_type"] in ("display_data", "update_display_data"):
            parts.append(m["content"].get("data", {}).get("text/plain", "") + "\n")
    return "".join(parts)


def test_ranks_printed_reads_both_label_forms():
    assert ranks_printed("[ranks 0-1] started\n", "started") == {0, 1}
    assert ranks_printed("[rank 1] started\n[rank 0] started\n", "started") == {0, 1}
    assert ranks_printed("[ranks 0,2-3] x\n[rank 1] y\n", "x") == {0, 2, 3}


def test_kernel_runs_the_venv_python(dist_kernel):
    out = dist_kernel.ok("import sys, nbdist; print(sys.executable); print(nbdist.__file__)").stdout
    executable, module = out.splitlines()
    assert executable == sys.executable
    import nbdist

    assert module == nbdist.__file__


def test_failing_rank_fails_the_cell(dist_kernel):
    result = dist_kernel.execute("%%on_all_ranks\n1/(rank-1)")
    assert result.status == "error"
    assert result.reply["ename"] == "RankError"
    assert result.reply["evalue"] == "rank 1: ZeroDivisionError: division by zero"
    # The error output, as the notebook shows it: rank 1's traceback, a summary line.
    assert len(result.errors) == 1
    text = result.error_text()
    assert "[rank 1] ZeroDivisionError: division by zero" in text
    assert "----> 1 1/(rank-1)" in text  # the rank's own traceback, not the kernel's
    assert "1 of 2 ranks failed" in text
    assert "rank 0" not in text  # rank 0 did not fail
    # Rank 0 succeeded: its value (1/(0-1)) is still shown, labelled.
    assert "[rank 0] -1.0" in result.stdout.splitlines()
    # The ranks are fine afterwards.
    after = dist_kernel.ok("%%on_all_ranks\nprint('ok', rank)").stdout
    assert "[rank 0] ok 0" in after and "[rank 1] ok 1" in after


def test_a_late_rank_joins_its_line_when_the_cell_ends(dist_kernel):
    """Live, rank 1's line comes 0.8 s after rank 0's (past the grouping window); the
    cell's output, once it ends, has the line once with both ranks, and the live copy
    drawn while it ran is blanked."""
    result = dist_kernel.ok(
        "%%on_all_ranks\nimport time\ntime.sleep(0.8 * rank)\nprint('epoch 1 done', flush=True)\n"
        "time.sleep(1.6 - 0.8 * rank)"
    )
    assert result.stdout == "[ranks 0-1] epoch 1 done\n"
    live = [m for m in result.outputs if m["msg_type"] in ("display_data", "update_display_data")]
    assert live, "no live view while the cell ran"
    assert live[-1]["content"]["data"] == {"text/plain": ""}


def test_what_one_rank_printed_shows_before_the_cells_value(dist_kernel):
    """A line only rank 0 printed, then the cell's value on every rank: the line comes
    first, as in a kernel of its own (it came after the values)."""
    result = dist_kernel.ok("%%on_all_ranks\nif rank == 0:\n    print('only zero')\nrank * 10")
    assert result.stdout == "[rank 0] only zero\n[rank 0] 0\n[rank 1] 10\n", result.stdout


def test_interrupt_stops_every_rank_and_the_next_cell_works(dist_kernel):
    kernel = dist_kernel
    msg_id = kernel.submit(
        "%%on_all_ranks\nimport time\nprint('started', flush=True)\ntime.sleep(120)"
    )
    outputs, idle = kernel.collect(
        msg_id, timeout=120, until=lambda outs: ranks_printed(shown_text(outs), "started") == {0, 1}
    )
    assert not idle, f"the cell ended before it was interrupted: {shown_text(outputs)!r}"

    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    more, idle = kernel.collect(msg_id, timeout=60)
    reply = kernel.reply(msg_id, timeout=30)
    seconds = time.monotonic() - t0
    assert seconds < 30, f"the interrupted cell took {seconds:.1f} s to end"

    # nbdist relays the interrupt to the ranks and ends the cell with a KeyboardInterrupt
    # (nbdist.RanksInterrupted) that shows where each rank stopped.
    assert reply["status"] == "error"
    assert reply["ename"] == "RanksInterrupted"
    errors = [m["content"] for m in more if m["msg_type"] == "error"]
    assert [e["ename"] for e in errors] == ["RanksInterrupted"]
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"]))
    assert shown.startswith("KeyboardInterrupt: the cell was interrupted on every rank")
    assert "[ranks 0-1] KeyboardInterrupt" in shown, shown
    assert "time.sleep(120)" in shown  # where the ranks were when they stopped
    assert "threading.py" not in shown  # not the kernel's own wait loop

    # The ranks stopped sleeping: the next cell runs at once (not after the 120 s sleep).
    result = kernel.ok("%%on_all_ranks\nprint(rank + 100)", timeout=60)
    assert "[rank 0] 100" in result.stdout
    assert "[rank 1] 101" in result.stdout
    assert result.seconds < 30, f"the next cell took {result.seconds:.1f} s"


def test_a_checkpoint_written_on_ctrl_c_is_written_whole(dist_kernel, tmp_path):
    """Training code that saves a checkpoint in ``except KeyboardInterrupt:`` saves it whole
    when the kernel is interrupted, and the cell says it waits for that code; before, the
    ranks were interrupted again 0.5 s later, inside the save."""
    kernel = dist_kernel
    folder = str(tmp_path)
    msg_id = kernel.submit(
        "%%on_all_ranks\n"
        "import os, time\n"
        "model = torch.nn.Linear(64, 64)\n"
        "try:\n"
        "    print('training', flush=True)\n"
        "    while True:\n"
        "        model(torch.randn(8, 64)).sum().backward()\n"
        "        time.sleep(0.01)\n"
        "except KeyboardInterrupt:\n"
        "    time.sleep(1.5)  # a large checkpoint takes a while\n"
        f"    torch.save(model.state_dict(), os.path.join({folder!r}, f'ckpt_{{rank}}.pt'))\n"
        "    print('checkpoint saved', flush=True)\n"
        "    raise\n"
    )
    outputs, idle = kernel.collect(
        msg_id,
        timeout=120,
        until=lambda outs: ranks_printed(shown_text(outs), "training") == {0, 1},
    )
    assert not idle, f"the cell ended before it was interrupted: {shown_text(outputs)!r}"
    kernel.km.interrupt_kernel()
    more, _ = kernel.collect(msg_id, timeout=60)
    reply = kernel.reply(msg_id, timeout=30)
    assert reply["ename"] == "RanksInterrupted"
    text = shown_text(more)
    assert ranks_printed(text, "checkpoint saved") == {0, 1}, text
    assert "this rank's code caught the KeyboardInterrupt and runs on" in text, text
    errors = [m["content"] for m in more if m["msg_type"] == "error"]
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"]))
    assert shown.endswith(
        "interrupted; every rank stopped (ranks 0-1 first ran their own code that caught the "
        "KeyboardInterrupt)"
    ), shown
    saved = kernel.ok(
        "%%on_all_ranks\n"
        f"back = torch.load(os.path.join({folder!r}, f'ckpt_{{rank}}.pt'))\n"
        "print(all(torch.equal(back[k], v) for k, v in model.state_dict().items()))"
    ).stdout
    assert "[ranks 0-1] True" in saved, saved


def _kill_kernel(kernel) -> None:
    pid = kernel.pid
    assert pid in {p.pid for p in psutil.Process().children()}  # our kernel, nothing else
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid], timeout=15) == []


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_kernel_shutdown_leaves_no_process(kernel_factory, how):
    kernel = kernel_factory()
    kernel.start_dist(2)
    pids = kernel.nbdist_pids()
    # controller (+ its schedulers), zygote, 2 engines: all alive now
    assert len(pids) >= 4
    assert wait_gone(pids, timeout=0) == pids

    t0 = time.monotonic()
    if how == "shutdown":
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)
    elif how == "restart":
        kernel.km.restart_kernel(now=False)
    else:
        _kill_kernel(kernel)
    left = wait_gone(pids, timeout=15)
    seconds = time.monotonic() - t0
    assert left == [], f"still running {seconds:.1f} s after {how}: {left}"

    if how == "restart":
        # The restarted kernel works (and has no cluster until %dist_start).
        kernel.kc.wait_for_ready(timeout=120)
        out = kernel.ok("%load_ext nbdist\n%dist_stop").stdout
        assert out.strip() == "nbdist: no cluster running"
