"""Two real kernels start the same named session at the same instant: one wins, nothing of the other.

The check that a name is free and the start of its keeper are one claim
(:func:`nbdist.launch.named_session_records.claim`): without it both kernels
found the name free, both started a keeper with its controller and ranks, and
one of those sets ran on with no record naming it.
"""

from __future__ import annotations

import os

import psutil
import pytest

from nbdist.launch import named_session_records
from tests.cluster.test_named_sessions import START_TIMEOUT, _Kernel, _session_pids
from tests.conftest import wait_gone

pytestmark = pytest.mark.slow  # two real kernels and a named session: ~20 s on 2 cores


def _keepers(runtime_dir: str) -> list[psutil.Process]:
    """The keeper processes whose records live under ``runtime_dir`` (this test's only)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "nbdist.launch.named_session_keeper" in cmdline and any(
            arg.startswith(runtime_dir) for arg in cmdline
        ):
            found.append(proc)
    return found


def _outcome(kernel: _Kernel, msg_id: str) -> tuple[bool, str]:
    try:
        return True, kernel.collect(msg_id, timeout=START_TIMEOUT + 60)
    except AssertionError as error:  # the cell raised: its traceback
        return False, str(error)


def test_two_kernels_starting_one_name_at_once_one_wins_the_other_is_told(tmp_path, monkeypatch):
    runtime = str(tmp_path / "runtime")
    env = dict(
        os.environ, NBDIST_HISTORY=str(tmp_path / "history.sqlite"), JUPYTER_RUNTIME_DIR=runtime
    )
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", runtime)  # the records this process reads
    kernels = []
    try:
        kernels = [_Kernel(env), _Kernel(env)]
        for kernel in kernels:
            kernel.ok("%load_ext nbdist")
        # Sent back to back: both checks that the name is free come long before either keeper
        # (a Python process of its own) could have written its record.
        ids = [k.kc.execute("%dist_start 2 --cpu --name race") for k in kernels]
        outcomes = [_outcome(k, i) for k, i in zip(kernels, ids)]
        won = [i for i, (ok, _) in enumerate(outcomes) if ok]
        assert len(won) == 1, outcomes
        winner, loser = kernels[won[0]], kernels[1 - won[0]]
        assert "2 ranks ready" in outcomes[won[0]][1], outcomes
        refusal = outcomes[1 - won[0]][1]
        assert (
            "'race' is being started by another kernel" in refusal
            or "a session named 'race' is running already" in refusal
        ), refusal
        # Nothing of the loser: one keeper, one record, the winner's ranks only.
        pids = _session_pids("race")
        assert len(_keepers(runtime)) == 1
        assert [r["name"] for r in named_session_records.records()] == ["race"]
        # The loser may use the session the winner started.
        winner.ok("%%on_all_ranks\nx = rank * 10")
        winner.ok("import nbdist\nnbdist.current_session().detach()")
        loser.ok("%dist_attach race")
        assert "[0, 10]" in loser.ok("import nbdist\nprint(nbdist.current_session().pull('x'))")
        loser.ok("%dist_stop race")
        assert wait_gone(pids) == []
        assert named_session_records.records() == []
        assert not [n for n in os.listdir(named_session_records.sessions_dir()) if "race" in n]
    finally:
        for kernel in kernels:
            kernel.shutdown()
        left = _keepers(runtime)
        if named_session_records.read("race") is not None:
            named_session_records.stop("race")
        for proc in left:  # a keeper no record names (what the claim prevents): by its PID
            try:
                proc.kill()
            except psutil.Error:
                pass
