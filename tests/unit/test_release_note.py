"""The words a release adds to a cell's error: ranks released from one place named together."""

from __future__ import annotations

from nbdist.driver.release_note import NO_ANSWER, STOPPED_PROCESS, released_parts


def test_ranks_of_one_place_are_named_together_and_the_silent_ones_say_why():
    parts = released_parts(
        {0: "all_reduce #3", 1: NO_ANSWER, 2: "all_reduce #3", 3: "its running code"}, ask_s=1.0
    )
    assert parts == [
        "ranks 0 and 2 from all_reduce #3",
        "rank 1 interrupted where it was (no answer within 1 s)",
        "rank 3 from its running code",
    ]


def test_a_stopped_process_is_said_to_be_stopped_not_silent():
    # Not asked (it cannot answer until continued), so no "within N s" either.
    assert released_parts({1: STOPPED_PROCESS}, ask_s=1.0) == [
        "rank 1 interrupted where it was (its process is stopped: the interrupt waits until "
        "continued)"
    ]
    assert released_parts({1: STOPPED_PROCESS, 2: STOPPED_PROCESS, 0: NO_ANSWER}, ask_s=2.0) == [
        "rank 0 interrupted where it was (no answer within 2 s)",
        "ranks 1 and 2 interrupted where they were (their processes are stopped: the interrupt "
        "waits until continued)",
    ]
