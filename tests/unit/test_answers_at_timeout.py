"""What a timed-out wait of nbdist's own says of each rank's answer (no engines: replies as
ipyparallel's futures hold them)."""

from __future__ import annotations

import doctest
from concurrent.futures import Future

from ipyparallel.error import RemoteError, TaskAborted

import nbdist.driver.rank_replies
from nbdist.driver.rank_replies import answers_at_timeout


def _answered(value=None, error: BaseException | None = None) -> Future:
    child = Future()
    if error is None:
        child.set_result(value)
    else:
        child.set_exception(error)
    return child


def test_the_modules_example_holds():
    failed, tried = doctest.testmod(nbdist.driver.rank_replies)
    assert tried >= 2 and failed == 0


def test_the_ranks_still_at_it_come_first_and_ranges_are_folded():
    children = [_answered({}), Future(), Future(), Future(), _answered({})]
    assert answers_at_timeout([0, 1, 2, 3, 4], children) == (
        "ranks 1-3 had not answered; ranks 0,4 had answered"
    )


def test_a_dropped_request_and_a_rank_s_own_error_are_told_apart():
    aborted = TaskAborted("msg-1")
    remote = RemoteError("DistStoreError", "timed out waiting for rank 1", "", {})
    children = [_answered(error=remote), Future(), _answered(error=aborted)]
    assert answers_at_timeout([0, 1, 2], children) == (
        "rank 1 had not answered; rank 0 had failed (DistStoreError); "
        "rank 2 had dropped it unrun (aborted)"
    )
