"""A start gives up at its --timeout wherever the engines leave it waiting, and says why.

Real engines started by hand (the ``external_cluster`` fixture), made to keep
nbdist waiting the ways a user meets: one busy with another client's work, one
stopped before the start asks it anything, one stopped while the group forms.
Then nbdist's own ranks: an engine stopped before it describes itself (the error says
what its process is doing), a re-forming with a rank stopped, and a join cut short on
one rank; the next try forms a working group in both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from contextlib import contextmanager

import pytest

import nbdist
import nbdist.driver.group as group_module
from nbdist.driver.runner import CellTimeout
from nbdist.errors import NbdistError, RankError
from tests.conftest import wait_gone


@contextmanager
def _probe(client_file):
    import ipyparallel as ipp

    client = ipp.Client(str(client_file))
    try:
        yield client
    finally:
        client.close()


def _engine_pids(client) -> dict[int, int]:
    return dict(zip(client.ids, client[client.ids].apply_sync(os.getpid)))


@contextmanager
def _stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _a_start_forms_the_group(client_file) -> None:
    s = nbdist.DistSession(connect=str(client_file), cpu=True, timeout=60).start()
    try:
        _reduces(s)
    finally:
        s.stop()


def _reduces(s) -> None:
    s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t)")
    assert [t.item() for t in s.pull("t")] == [3.0, 3.0]


def _wait_for_empty_queue(client, engine: int) -> None:
    deadline = time.monotonic() + 30
    while client.queue_status(targets=[engine])[engine]["queue"]:
        assert time.monotonic() < deadline, client.queue_status(targets=[engine], verbose=True)
        time.sleep(0.1)


def test_an_engine_busy_with_other_work_ends_the_start_at_its_timeout(external_cluster):
    client_file, procs = external_cluster
    with _probe(client_file) as other:
        busy = other.ids[1]
        work = other[[busy]].apply_async(time.sleep, 600)
        t0 = time.monotonic()
        with pytest.raises(NbdistError) as caught:
            nbdist.DistSession(connect=str(client_file), cpu=True, timeout=4).start()
        waited = time.monotonic() - t0
        assert str(caught.value) == (
            f"engine {busy} did not answer within 4 s (%dist_start --timeout 4) when nbdist "
            "asked it for its host, address and devices: it is running other work (1 request "
            "before nbdist's): let that finish or interrupt it, then start again. nbdist took "
            "its request back."
        )
        assert waited < 60  # it gave up: before, it waited for the work (600 s)
        # The other client's work goes on; nbdist stopped nothing it did not start.
        assert not work.ready()
        assert all(p.poll() is None for p in procs)
        other.send_signal(signal.SIGINT, targets=[busy], block=True)
        with pytest.raises(Exception, match="KeyboardInterrupt"):
            work.get(30)
        # Freed, the engine answers the request nbdist took back as aborted, not run.
        _wait_for_empty_queue(other, busy)
        done = other.queue_status(targets=[busy], verbose=True)[busy]["completed"]
        (nbdist_request,) = set(done) - set(work.msg_ids)
        (record,) = other.db_query({"msg_id": nbdist_request}, keys=["result_content"])
        assert record["result_content"]["status"] == "aborted", record
    _a_start_forms_the_group(client_file)


# A stopped engine misses the controller's heartbeats: at 100 ms the controller calls it
# dead within a second or two, ipyparallel's own answer. At 6 s (10 missed beats: a minute)
# the start's --timeout comes first, and the engine stopped for a failed start (15 s here)
# is still the controller's when it continues. At ipyparallel's default 3 s (33 s), with a
# failed start of 25 s (before its settling stopped waiting for a rank that ended at once),
# one run on three loaded workers waited out the next start's 60 s: most likely the
# controller dropped the engine while that start formed the group (stopped for 60 s, the
# engine is gone from the controller's list when it continues).
SLOW_HEARTBEAT = pytest.mark.parametrize("external_cluster", [6000], indirect=True)


@SLOW_HEARTBEAT
def test_a_stopped_engine_ends_the_start_at_its_timeout_and_is_named(external_cluster):
    client_file, _procs = external_cluster
    with _probe(client_file) as other:
        pids = _engine_pids(other)
    stopped = max(pids)
    with _stopped(pids[stopped]), pytest.raises(NbdistError) as caught:
        nbdist.DistSession(connect=str(client_file), cpu=True, timeout=3).start()
    assert str(caught.value).startswith(
        f"engine {stopped} did not answer within 3 s (%dist_start --timeout 3) when nbdist "
        "asked it for its host, address and devices: it holds nbdist's request alone, so it "
        "is stopped (SIGSTOP), swapping, or hung in native code"
    )


@SLOW_HEARTBEAT
def test_an_engine_stopped_while_the_group_forms_ends_the_start_with_a_timeout(
    external_cluster, monkeypatch
):
    """Stopped after describing itself: the ranks are interrupted by engine, the start ends."""
    client_file, procs = external_cluster
    with _probe(client_file) as other:
        pids = _engine_pids(other)
    stopped = max(pids)
    asked = group_module.ask_engines

    def then_stop_one(client, engine_ids, fn, *args, **kwargs):
        # After rank 0 opened the rendezvous, before any rank joins: one engine stops.
        answer = asked(client, engine_ids, fn, *args, **kwargs)
        if fn.__name__ == "open_rendezvous":
            os.kill(pids[stopped], signal.SIGSTOP)
        return answer

    monkeypatch.setattr(group_module, "ask_engines", then_stop_one)
    try:
        with pytest.raises(CellTimeout) as caught:
            nbdist.DistSession(connect=str(client_file), cpu=True, timeout=4).start()
    finally:
        os.kill(pids[stopped], signal.SIGCONT)
    text = str(caught.value)
    assert text.startswith(
        "forming the process group (%dist_start --timeout 4) took longer than 4 s on 2 "
        "rank(s) and was interrupted ("
    ), text
    # The stopped rank is named as the one that had not answered (rank 0, waiting for it in
    # torch's store, times out at the same 4 s: with it, or as failed).
    assert "rank 1 had not answered" in text or "ranks 0-1 had not answered" in text, text
    # What its process was doing, read as the wait ended; the engines stay, so the fix is named.
    pid = pids[stopped]
    assert (
        f"the process here of rank 1 (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its "
        f"terminal): `kill -CONT {pid}` lets it go on"
    ) in text, text
    assert all(p.poll() is None for p in procs)
    monkeypatch.setattr(group_module, "ask_engines", asked)
    # The rank that was waiting for it was interrupted: a fresh start forms the group.
    _a_start_forms_the_group(client_file)


def test_an_engine_of_nbdists_stopped_before_the_start_asks_it_is_named_with_its_state(
    monkeypatch,
):
    """nbdist started the engines: the error says what the silent one's process is doing,
    read from the process table, not a list of what it might be (a stop, swap, native code),
    and, the failed start having stopped the engines, names no command to run on it."""
    asked = group_module.ask_engines
    stopped: list[tuple[int, int]] = []  # (engine id, pid)

    def stop_one_first(client, engine_ids, fn, *args, **kwargs):
        if fn.__name__ == "describe_rank" and not stopped:
            pids = client[list(engine_ids)].apply_sync(os.getpid)
            stopped.append((engine_ids[-1], pids[-1]))
            os.kill(pids[-1], signal.SIGSTOP)
        return asked(client, engine_ids, fn, *args, **kwargs)

    monkeypatch.setattr(group_module, "ask_engines", stop_one_first)
    session = nbdist.DistSession(2, cpu=True, timeout=5)
    try:
        with pytest.raises(NbdistError) as caught:
            session.start()
        # Still stopped when the failed start ended the engines: ended all the same.
        assert wait_gone([pid for _engine, pid in stopped]) == []
    finally:
        for _engine, pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    ((engine, pid),) = stopped
    assert str(caught.value) == (
        f"engine {engine} did not answer within 5 s (%dist_start --timeout 5) when nbdist "
        "asked it for its host, address and devices: it holds nbdist's request alone; its "
        f"process here (pid {pid}) is stopped (SIGSTOP, or Ctrl-Z in its terminal). nbdist "
        "took its request back."
    )


def test_a_rank_stopped_while_the_group_forms_again_leaves_the_next_try_a_clean_group():
    """A re-forming cut short by a rank stopped after it began: rank 0 waits for it in
    torch's store, where a SIGINT does not reach it. Before, rank 0 stayed there for
    --group-timeout (300 s here) and the next try timed out (at 120 s); now the store's
    waits while joining end with the --timeout (4 s here), and the request the stopped rank
    had not begun is taken back. (A rank already stopped when the re-forming begins is
    refused at once: tests/faults/test_stopped_rank.py.)
    """
    s = nbdist.DistSession(2, cpu=True, timeout=120, group_timeout=300).start()
    try:
        stopped = s.ranks[1].pid
        # Rank 1 stops itself 2 s on, in a cell of its own: the re-forming's request, queued
        # behind that cell, is never begun.
        busy = s.run(
            "import os, signal, time\ntime.sleep(2)\nos.kill(os.getpid(), signal.SIGSTOP)",
            ranks=1,
            block=False,
        )
        try:
            with pytest.raises(CellTimeout, match="forming the process group") as e:
                group_module.reform_group(
                    s.client, s.group, group_timeout=300, timeout=4, interrupt=s.interrupt
                )
        finally:
            os.kill(stopped, signal.SIGCONT)
        assert f"the process here of rank 1 (pid {stopped}) is stopped" in str(e.value), e.value
        assert s.group.released  # the next cell would try again: here, by hand
        with contextlib.suppress(RankError):  # the re-forming's SIGINT, taken once continued
            busy.wait()
        s.reform_group()
        _reduces(s)
    finally:
        s.stop()


CUT_SHORT_ON_RANK_0 = """
import datetime
from nbdist.engine import user_group
if rank == 0:
    # What a join cut short leaves: torch counted the group, and no group exists.
    user_group.original("destroy_process_group")()
    try:
        user_group.original("init_process_group")(
            "gloo", store=dist.HashStore(), rank=0, world_size=2,
            timeout=datetime.timedelta(seconds=1),
        )
    except Exception as e:
        cut = type(e).__name__
counted = dist.distributed_c10d._world.group_count
"""


def test_a_join_cut_short_on_one_rank_leaves_the_next_join_a_clean_group():
    """torch counts the groups a process formed and names each by that count; the ranks
    must agree on it. A join cut short counted on some ranks only: the next one waited
    (here 20 s, the join's timeout) under names that differ, every later try too."""
    s = nbdist.DistSession(2, cpu=True, timeout=20).start()
    try:
        s.run(CUT_SHORT_ON_RANK_0, ranks=0)
        assert s.pull("cut", 0) == "DistStoreError"  # no rank 1 came
        s.run("counted = dist.distributed_c10d._world.group_count", ranks=1)
        assert s.pull("counted") == [1, 1]  # rank 0: the cut-short group; rank 1: its group
        s.reform_group()
        _reduces(s)
    finally:
        s.stop()
