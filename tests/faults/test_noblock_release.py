"""A cell sent without waiting (``--noblock``) where a rank fails while the other waits in a
collective (2 real gloo ranks).

Nothing waits for such a cell until ``.wait()``; its guard is driven by ``done()`` and by
every other wait of the session. The group's own timeout is 60 s here: without that, the
waiting rank would stay in its all-reduce until then, and the cell queued behind it would be
blamed for the wait.
"""

from __future__ import annotations

import time

import pytest

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from tests.faults.two_ranks import reduce_works, two_ranks

# Rank 1 fails 1 s in; rank 0 waits for it in an all-reduce it never enters.
_FAILING = (
    "import time\n"
    "time.sleep(1)\n"
    "if rank == 1:\n"
    "    raise ValueError('bad batch on rank 1')\n"
    "dist.all_reduce(torch.ones(4))\n"
)


@pytest.fixture(scope="module")
def session():
    with two_ranks() as s:
        yield s


def _waited_for(session, run, formed: str) -> None:
    """``run.wait()`` names the failing rank alone, with its own error, and the waiting rank as
    released; ``formed``: what the note says of the group; the group works."""
    with pytest.raises(RankError) as info:
        run.wait()
    err = info.value
    assert [(f.rank, f.ename) for f in err.failures] == [(1, "ValueError")], str(err)
    assert "rank 1 failed; the others were released: rank 0 from all_reduce #" in str(err)
    assert formed in str(err), str(err)
    reduce_works(session)


def test_a_noblock_cell_polled_with_done_ends_when_a_rank_fails(session):
    run = session.run(_FAILING, block=False, sink=ListSink())
    t0 = time.monotonic()
    # Well inside the group's 60-s timeout, which alone ended the wait before.
    while not run.done() and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert run.done(), "the rank waiting for the failed one was not released"
    _waited_for(session, run, "formed again; variables and models are kept")


def test_a_cell_queued_behind_a_failed_noblock_cell_is_not_blamed_for_its_wait(session):
    background = session.run(_FAILING, block=False, sink=ListSink())
    # Sent at once: queued behind the failing cell on both ranks (or, on a slow machine,
    # begun on rank 1 once it failed there). It makes no collective call.
    with pytest.raises(RankError) as queued:
        session.run("after = rank", sink=ListSink())
    err = queued.value
    # Where it was queued behind the failed cell, a rank dropped it: not a wait of its own.
    assert {f.ename for f in err.failures} == {"NotRun"}, str(err)
    assert 0 in err.ranks
    assert "released" not in str(err) and "CollectiveMismatch" not in str(err), str(err)
    # Where to look for why.
    assert (
        "rank 1 failed the --noblock cell sent before this one: its run's .wait() (the value "
        "that cell returned) shows the error"
    ) in str(err), str(err)
    _waited_for(session, background, "formed again for a later cell; variables and models are kept")


def test_a_noblock_cell_that_ends_well_is_left_alone_by_the_cells_after_it(session):
    # Rank 0 waits 2 s in the all-reduce for rank 1, which computes: no failure, no release.
    background = session.run(
        "import time\nif rank == 1:\n    time.sleep(2)\nt = torch.ones(1)\ndist.all_reduce(t)",
        block=False,
        sink=ListSink(),
    )
    session.run("after = rank", sink=ListSink())
    background.wait()
    assert [t.item() for t in session.pull("t")] == [2.0, 2.0]
    assert session.pull("after") == [0, 1]


@pytest.mark.parametrize("send", ["cell", "apply"])
def test_a_request_sent_once_a_rank_failed_waits_for_the_others_release(session, send, capsys):
    failing = _FAILING.replace(
        "dist.all_reduce(torch.ones(4))", "t = torch.ones(4)\ndist.all_reduce(t)"
    )
    background = session.run(failing, block=False, sink=ListSink())
    # Read without driving the guard: rank 1 has failed, rank 0 still waits in its all-reduce.
    while background.child_states()[1] != "error":
        time.sleep(0.01)
    assert background.child_states()[0] == "running"
    # Sent now, this all-reduce would begin at once on the idle rank 1 and pair with rank 0's
    # open one: gloo pairs by order, so both got wrong values (rank 1 [1.0] for 3.0), and the
    # request, dropped on rank 0 behind its failed cell, had run on rank 1 alone.
    if send == "cell":
        session.run("u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u)", sink=ListSink())
        assert [u.item() for u in session.pull("u")] == [3.0, 3.0]
    else:
        assert session.apply(_reduced_rank) == [3.0, 3.0]
    # Rank 0's tensor was not touched by rank 1's all-reduce.
    assert session.pull("t", 0).tolist() == [1.0] * 4
    # The request began seconds late, and the user was told why, once.
    said = capsys.readouterr().err
    line = (
        "nbdist: rank 1 failed a --noblock cell that rank 0 still runs (waiting for it in a "
        "collective, or computing): this begins on the ranks once rank 0 is released (a few "
        "seconds); that cell's .wait() shows the error"
    )
    assert said.count(line) == 1, said
    _waited_for(session, background, "formed again for a later cell; variables and models are kept")


def _reduced_rank() -> float:
    """On a rank: its rank + 1, summed over the ranks."""
    import torch
    import torch.distributed as dist

    u = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(u)
    return u.item()


def test_a_dropped_cell_names_only_the_failed_noblock_cell_it_was_queued_behind(session):
    earlier = session.run(_FAILING, block=False, sink=ListSink())
    while not earlier.done():
        time.sleep(0.1)
    session.run("between = rank", sink=ListSink())
    # The earlier run failed and nobody asked its .wait(); the next one is the cause.
    later = session.run(_FAILING, block=False, sink=ListSink())
    with pytest.raises(RankError) as queued:
        session.run("after = rank", sink=ListSink())
    text = str(queued.value)
    assert {f.ename for f in queued.value.failures} == {"NotRun"}, text
    # One line, for the run the cell was queued behind: the earlier one ended before it was sent.
    assert text.count("rank 1 failed the --noblock cell sent before this one") == 1, text
    _waited_for(session, later, "formed again for a later cell; variables and models are kept")
    _waited_for(session, earlier, "formed again for a later cell; variables and models are kept")
