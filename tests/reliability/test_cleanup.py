"""The kernel goes (shut down, restarted, SIGKILLed): every process nbdist started is gone within 10 s.

Checked by PID on every process below the kernel, found independently of
nbdist (psutil), while the ranks are idle, running a cell, or blocked in a
collective. The 10 s count from the moment the kernel process ended. What
makes it hold: nbdist's shutdown hook stops the cluster; and when the kernel is
killed outright, the controller (``nbdist.launch.parent_watchdog``) and the engine zygote
(``nbdist.launch.zygote``) notice their parent is gone and end themselves and the
engines, which also die with the zygote (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.conftest import wait_gone
from tests.notebooks.test_kernel import ranks_printed, shown_text
from tests.reliability.conftest import DeathClock, survivors

GRACE_S = 10.0

# Rank 0 waits in an all_reduce that rank 1 never joins (it sleeps): blocked in a collective.
BLOCKED = (
    "%%on_all_ranks\nimport time\nprint('started', flush=True)\n"
    "if rank == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n    time.sleep(600)"
)
BUSY = "%%on_all_ranks\nimport time\nprint('started', flush=True)\ntime.sleep(600)"


def _start_cell(kernel, code: str) -> None:
    msg_id = kernel.submit(code)
    outputs, idle = kernel.collect(
        msg_id, timeout=120, until=lambda outs: ranks_printed(shown_text(outs), "started") == {0, 1}
    )
    assert not idle, f"the cell ended early: {shown_text(outputs)!r}"


@pytest.mark.parametrize(
    "how, ranks",
    # Idle ranks after a SIGKILL are in tests/notebooks/test_kernel.py; these are the hard cases.
    [("shutdown", "idle"), ("restart", "busy"), ("sigkill", "blocked")],
)
def test_every_process_nbdist_started_is_gone_within_10_s(kernels, how, ranks, tmp_path):
    # The kernels' temp dir is the test's own: every local start sweeps its temp dir for
    # profile directories whose kernel is gone, and a start on another pytest worker
    # removed the killed kernel's before this test's next start could (CI, 2026-12-07).
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(own_tmp)}
    kernel = kernels(env)
    kernel.start_dist(2)
    pids = kernel.descendants()
    own = kernel.nbdist_pids()
    # nbdist's own list is true (controller, its schedulers, zygote, 2 engines) and
    # the kernel started nothing else nbdist does not know of.
    assert set(own) <= set(pids) and len(own) >= 4, (own, pids)
    assert set(pids) == set(own), f"processes below the kernel nbdist does not track: {pids}"
    profile = kernel.ok(
        "import nbdist\nprint(nbdist.current_session().cluster.profile_dir)"
    ).stdout.strip()
    assert os.path.isdir(profile) and profile.startswith(str(own_tmp)), profile
    if ranks != "idle":
        _start_cell(kernel, BLOCKED if ranks == "blocked" else BUSY)

    clock = DeathClock(kernel.pid)
    if how == "shutdown":
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)
    elif how == "restart":
        kernel.km.restart_kernel(now=False)
    else:
        os.kill(kernel.pid, signal.SIGKILL)
    ended = clock.wait()
    left = survivors(pids, until=ended + GRACE_S)
    assert left == [], (
        f"{len(left)} processes still running {GRACE_S:g} s after the kernel {how} "
        f"(ranks {ranks}):\n" + "\n".join(left)
    )
    gone_after = time.monotonic() - ended
    print(
        f"{how} with ranks {ranks}: every nbdist process gone {gone_after:.1f} s after the kernel"
    )
    if how == "sigkill":
        # A killed kernel cannot remove its private profile directory; the next start does.
        assert os.path.isdir(profile), "the killed kernel's profile directory vanished by itself"
        kernels(env).start_dist(2)
        assert not os.path.exists(profile), f"{profile} outlived the next %dist_start"
    else:
        assert not os.path.exists(profile), f"{profile} outlived the kernel's {how}"

    if how == "restart":
        # The new kernel works, and has no cluster until %dist_start.
        kernel.kc.wait_for_ready(timeout=120)
        assert kernel.ok("%load_ext nbdist\n%dist_stop").stdout.strip() == (
            "nbdist: no cluster running"
        )


def test_an_interrupt_during_dist_stop_lets_the_stop_finish_first(kernels):
    # Each rank's cell started a process that ignores SIGTERM: the stop then waits out the
    # grace before SIGKILL, and the interrupt comes during that wait.
    kernel = kernels()
    kernel.start_dist(2)
    profile = kernel.ok(
        "import nbdist\nprint(nbdist.current_session().cluster.profile_dir)"
    ).stdout.strip()
    kernel.ok(
        "%%on_all_ranks\nimport subprocess\n"
        "stubborn = subprocess.Popen(['sh', '-c', 'trap \"\" TERM; sleep 600'])"
    )
    ranks = kernel.nbdist_pids()
    pids = kernel.descendants()
    engines = [
        int(p)
        for p in kernel.ok("print(*[r.pid for r in nbdist.current_session().ranks])").stdout.split()
    ]
    msg_id = kernel.submit("%dist_stop")
    # The ranks end first; the stubborn processes stay until SIGKILL, 3 s later.
    assert wait_gone(engines, timeout=60) == []
    kernel.km.interrupt_kernel()
    outputs, _ = kernel.collect(msg_id, timeout=120)
    reply = kernel.reply(msg_id)
    # The user's interrupt is not lost: the cell ends in KeyboardInterrupt, after the stop.
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    left = survivors(pids, until=time.monotonic() + GRACE_S)
    assert left == [], "left running after an interrupted %dist_stop:\n" + "\n".join(left)
    assert set(ranks) <= set(pids)
    assert not os.path.exists(profile), f"{profile} (it holds the cluster key) outlived the stop"
    assert kernel.ok("%dist_stop").stdout.strip() == "nbdist: no cluster running"


def _engines_below(kernel) -> list[int]:
    found = []
    for pid in kernel.descendants():
        try:
            line = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            continue
        if "engine" in line and "controller" not in line:
            found.append(pid)
    return found


def test_an_interrupted_dist_restart_says_the_ranks_were_stopped_and_leaves_nothing(kernels):
    kernel = kernels()
    kernel.ok("%load_ext nbdist")
    kernel.ok("%dist_start 2 --cpu --spawn", timeout=240)
    before = set(_engines_below(kernel))
    # Spawned ranks restart in full (stop, then start): the new engines import torch
    # before they register, and the interrupt comes while the restart waits for them.
    msg_id = kernel.submit("%dist_restart")
    deadline = time.monotonic() + 60
    while len(set(_engines_below(kernel)) - before) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = kernel.descendants()
    assert len(set(_engines_below(kernel)) - before) == 2, "the restart launched no engines"
    kernel.km.interrupt_kernel()
    outputs, _ = kernel.collect(msg_id, timeout=120)
    reply = kernel.reply(msg_id)
    # Before: a bare KeyboardInterrupt with the restart's frames, and nothing said the
    # ranks were gone until the next cell found no cluster.
    assert (reply["status"], reply["ename"]) == ("error", "UsageError"), reply
    assert reply["evalue"] == (
        "%dist_restart interrupted: the ranks were stopped (a group half formed is of no use); "
        "%dist_start starts them again"
    )
    left = survivors([*before, *seen, *kernel.descendants()], until=time.monotonic() + GRACE_S)
    assert left == [], "left running after an interrupted %dist_restart:\n" + "\n".join(left)
    assert "nbdist: 2 ranks ready" in kernel.ok("%dist_start 2 --cpu").stdout


def test_an_interrupted_dist_start_is_one_line_and_leaves_nothing(kernels):
    kernel = kernels()
    kernel.ok("%load_ext nbdist")
    # Spawned ranks each import torch before they register: the interrupt, sent once both
    # engine processes run (nothing more is launched after them), comes while the start
    # still waits for them.
    msg_id = kernel.submit("%dist_start 2 --cpu --spawn")
    deadline = time.monotonic() + 60
    while len(_engines_below(kernel)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = kernel.descendants()
    assert len(_engines_below(kernel)) == 2, "the start launched no engines"
    kernel.km.interrupt_kernel()
    outputs, _ = kernel.collect(msg_id, timeout=120)
    reply = kernel.reply(msg_id)
    assert (reply["status"], reply["ename"]) == ("error", "UsageError"), reply
    said = "%dist_start interrupted: what it had started was stopped; run it again to start"
    assert reply["evalue"] == said
    # The one line is all the cell shows: not ipyparallel's warning of the controller nbdist
    # stopped ("Controller stopped: {'exit_code': <Negsignal.SIGTERM: -15> ...}").
    shown = "".join(o["content"].get("text", "") for o in outputs if o["msg_type"] == "stream")
    assert shown.strip() == f"UsageError: {said}", shown
    assert not reply["traceback"] or len(reply["traceback"]) <= 2, reply["traceback"]
    left = survivors([*seen, *kernel.descendants()], until=time.monotonic() + GRACE_S)
    assert left == [], "left running after an interrupted %dist_start:\n" + "\n".join(left)
    assert "nbdist: 2 ranks ready" in kernel.ok("%dist_start 2 --cpu").stdout


def _blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    return 0


def test_a_zygote_stopped_while_it_imports_torch_ends_at_once():
    """A start stopped early (it failed, or was interrupted) ends a zygote still importing.

    The zygote blocks SIGINT (relayed to the ranks later) from its first line; it held
    SIGTERM too, until it had imported torch and forked, so a stop waited for the import
    (on a busy machine ipyparallel's SIGKILL came 5 s later, with a warning in the cell).
    With no rank forked there is nothing to end but the zygote: SIGTERM ends it.
    """
    import subprocess
    import sys

    zygote = subprocess.Popen(
        [sys.executable, "-m", "nbdist.launch.zygote", "--slots", "[]"]
        + ["--parent-pid", str(os.getpid())]
    )
    try:
        deadline = time.monotonic() + 60
        # SIGINT blocked: its own line has run, and torch is being imported (~1 s).
        while not _blocked_signals(zygote.pid) & (1 << (signal.SIGINT - 1)):
            assert zygote.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(zygote.pid, signal.SIGTERM)
        # Ended by the signal itself; a zygote that held it until after its import and
        # fork ended by its handler, with exit code 0.
        assert zygote.wait(60) == -signal.SIGTERM
    finally:
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()
