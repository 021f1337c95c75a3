"""A rank that cannot join ends the start (or the group's re-forming after a release) at
once, with its own error, not the --timeout's.

Real engines: started by hand (the ``external_cluster`` fixture) for a rank whose way in
raises, as a GPU it cannot take would; nbdist's own for a rank killed while the others wait
for it in torch's store. Before, the others waited there until the start's --timeout (120 s
by default) and the start said only that it timed out ("rank 1 had failed (RuntimeError)").
Then a session's rank whose way back in fails when the group forms again.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

import nbdist
import nbdist.driver.group as group_module
from nbdist.errors import RankError

# Run on the engine (its namespace): the first step of a rank's join that can fail on one
# rank alone, made to raise as a GPU the rank cannot take would; then mended.
_BREAK_THE_WAY_IN = """
import torch
def _refuse(_threads):
    raise RuntimeError("CUDA error: invalid device ordinal (on this rank only)")
torch.set_num_threads = _refuse
"""
_MEND_THE_WAY_IN = "torch.set_num_threads = torch._C.set_num_threads"


def test_a_rank_whose_way_in_fails_ends_the_start_with_its_error(external_cluster):
    import ipyparallel as ipp

    client_file, procs = external_cluster
    other = ipp.Client(str(client_file))
    try:
        broken = max(other.ids)
        other[[broken]].execute(_BREAK_THE_WAY_IN, block=True)
        with pytest.raises(RankError) as caught:  # not a CellTimeout: no waiting for 15 s
            nbdist.DistSession(connect=str(client_file), cpu=True, timeout=15).start()
        error = caught.value
        assert [(f.rank, f.ename) for f in error.failures] == [(1, "RuntimeError")], str(error)
        assert "invalid device ordinal (on this rank only)" in error.failures[0].evalue
        # Rank 0 was left waiting, not interrupted (a SIGINT in an import it may still be
        # doing breaks the engine for good); it gives up by itself.
        assert error.note == (
            "the process group did not form: rank 0 waited for the rank(s) above to join; "
            "each gives up its wait in torch's store after --timeout (15 s), then takes "
            "nbdist's next request"
        )
        assert all(p.poll() is None for p in procs)  # nbdist stops nothing it did not start
        other[[broken]].execute(_MEND_THE_WAY_IN, block=True)
    finally:
        other.close()
    # The next start waits for rank 0's request to end, then forms a working group.
    s = nbdist.DistSession(connect=str(client_file), cpu=True, timeout=60).start()
    try:
        s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)")
        assert [t.item() for t in s.pull("t")] == [3.0, 3.0]
    finally:
        s.stop()


def test_a_rank_killed_while_the_others_join_ends_the_start_saying_how(monkeypatch):
    asked = group_module.ask_engines
    pids: dict[int, int] = {}
    killed: list[int] = []

    def then_kill_one(client, engine_ids, fn, *args, **kwargs):
        answer = asked(client, engine_ids, fn, *args, **kwargs)
        if fn.__name__ == "describe_rank":
            pids.update((eid, info["pid"]) for eid, info in zip(engine_ids, answer))
        elif fn.__name__ == "open_rendezvous":
            # Rank 0 has opened the rendezvous; before any rank joins, another one is killed.
            (victim,) = set(pids) - set(engine_ids)
            killed.append(pids[victim])
            os.kill(pids[victim], signal.SIGKILL)
        return answer

    monkeypatch.setattr(group_module, "ask_engines", then_kill_one)
    session = nbdist.DistSession(2, cpu=True)  # --timeout 120 s, the default
    with pytest.raises(RankError) as caught:  # at once, not a CellTimeout after 120 s
        session.start()
    error = caught.value
    assert [(f.rank, f.ename) for f in error.failures] == [(1, "RankDied")], str(error)
    assert error.failures[0].evalue.startswith(f"pid {killed[0]} killed by SIGKILL"), str(error)
    assert (
        error.note == "the process group did not form: rank 0 waited for the rank(s) above to join"
    )
    assert not session.running
    assert not [p for p in pids.values() if psutil.pid_exists(p)]  # the failed start stopped it


# Run on a session's rank: its way back into the group (a fresh store) fails, as on a GPU that
# a fault left unusable; then mended.
_BREAK_THE_WAY_BACK = """
import torch.distributed
_store = torch.distributed.TCPStore
def _refuse(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access was encountered (on this rank only)")
torch.distributed.TCPStore = _refuse
"""
_MEND_THE_WAY_BACK = "torch.distributed.TCPStore = _store"


def test_a_rank_whose_way_back_in_fails_ends_the_re_forming_with_its_error():
    s = nbdist.DistSession(2, cpu=True, timeout=10).start()
    try:
        rank1 = s.client[[s.ranks[1].engine_id]]
        rank1.execute(_BREAK_THE_WAY_BACK, block=True)
        # A cell fails on rank 1 while rank 0 waits in a collective: rank 0 is released, and
        # the group formed again at once, where rank 1's way back fails.
        with pytest.raises(RankError) as caught:
            s.run(_FAILS_ON_RANK_1_BESIDE_A_COLLECTIVE)
        assert caught.value.note == (
            "rank 1 failed; the others were released: rank 0 from all_reduce #1. Forming the "
            "process group again failed (rank 1: RuntimeError: CUDA error: an illegal memory "
            "access was encountered (on this rank only); the process group did not form: rank "
            "0 waited for the rank(s) above to join; each gives up its wait in torch's store "
            "after --timeout (10 s), then takes the next cell, which tries again; %dist_restart "
            "starts fresh ranks)."
        )
        _wait_until_idle(s, 0)
        # Asked again (as the next cell would), the same, with the rank's own traceback.
        with pytest.raises(RankError) as caught:  # not a CellTimeout after 10 s
            s.reform_group()
        error = caught.value
        assert [(f.rank, f.ename) for f in error.failures] == [(1, "RuntimeError")], str(error)
        assert "an illegal memory access was encountered (on this rank only)" in str(error)
        assert error.note == (
            "the process group did not form: rank 0 waited for the rank(s) above to join; "
            "each gives up its wait in torch's store after --timeout (10 s), then takes the "
            "next cell, which tries again; %dist_restart starts fresh ranks"
        )
        assert s.group.released  # the next cell tries again
        traceback = re.sub(r"\x1b\[[0-9;]*m", "", error.failures[0].traceback)
        assert "in _join_group" in traceback and "in _refuse" in traceback, traceback
        rank1.execute(_MEND_THE_WAY_BACK, block=True)
        _wait_until_idle(s, 0)
        s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)")  # forms the group first
        assert not s.group.released
        assert [t.item() for t in s.pull("t")] == [3.0, 3.0]
    finally:
        s.stop()


_FAILS_ON_RANK_1_BESIDE_A_COLLECTIVE = """
t = torch.ones(1)
if rank == 1:
    raise ValueError("a bad batch")
dist.all_reduce(t)
"""


def _wait_until_idle(s, rank: int) -> None:
    # A rank left waiting in torch's store ends that wait by itself (nothing interrupted it).
    engine = s.ranks[rank].engine_id
    deadline = time.monotonic() + 30
    while s.client.queue_status(targets=[engine])[engine]["queue"]:
        assert time.monotonic() < deadline, f"rank {rank} still waits in the store after 30 s"
        time.sleep(0.1)
