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


def test_ranks_interrupted_in_a_collective_are_named_with_the_others_released_from_it():
    # At 256 ranks on 2 cores, which ranks the release freed in time and which it interrupted
    # is chance: one collective's ranks read as two places, each a long list.
    place = "all_reduce #1"
    mixed = {r: place for r in range(256) if r != 3}
    mixed.update({r: f"{place} (interrupted)" for r in range(100, 242)})
    assert released_parts(mixed, ask_s=1.0) == [
        "ranks 0-2,4-255 from all_reduce #1 (142 of them interrupted)"
    ]
    few = {0: place, 1: f"{place} (interrupted)", 2: place, 5: f"{place} (interrupted)"}
    few[4] = "its running code (interrupted)"
    assert released_parts(few, ask_s=1.0) == [
        "ranks 0-2,5 from all_reduce #1 (ranks 1 and 5 interrupted)",
        "rank 4 from its running code (interrupted)",
    ]
    # Every rank of a place interrupted: said once, as before.
    assert released_parts({0: f"{place} (interrupted)", 1: f"{place} (interrupted)"}, ask_s=1) == [
        "ranks 0 and 1 from all_reduce #1 (interrupted)"
    ]
