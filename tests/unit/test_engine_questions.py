"""The words of a start that engines left waiting: several engines, and a silent controller."""

from __future__ import annotations

import doctest

import nbdist.driver.engine_questions
from nbdist.driver.engine_questions import silent_engines_message

ASKING = "for its host, address and devices"


def test_the_modules_example_holds():
    failed, tried = doctest.testmod(nbdist.driver.engine_questions)
    assert tried >= 1 and failed == 0


def test_busy_and_stopped_engines_are_named_apart():
    text = silent_engines_message([1, 3, 4], {1: 2, 3: 0, 4: 1}, 30, ASKING)
    assert text == (
        "engines 1,3,4 did not answer within 30 s (%dist_start --timeout 30) when nbdist asked "
        "each for its host, address and devices: engines 1,4 are running other work (2 "
        "requests, 1 request before nbdist's): let that finish or interrupt it, then start "
        "again; engine 3 holds nbdist's request alone, so it is stopped (SIGSTOP), "
        "swapping, or hung in native code: py-spy dump --pid shows where. nbdist took its "
        "request back."
    )


def test_without_the_controllers_count_the_engines_are_still_named():
    text = silent_engines_message([0, 1], None, 2.5, ASKING)
    assert text.startswith("engines 0,1 did not answer within 2.5 s (%dist_start --timeout 2.5)")
    assert text.endswith(
        ": the controller did not say what they hold. nbdist took its request back."
    )


def test_one_busy_engine_among_several_reads_in_the_singular():
    text = silent_engines_message([2, 5, 7], {2: 1, 5: 0, 7: 0}, 9, ASKING)
    assert ": engine 2 is running other work (1 request before nbdist's)" in text
    assert "; engines 5,7 hold nbdist's request alone, so they are stopped" in text


def test_known_states_replace_the_list_of_causes():
    text = silent_engines_message([0, 1], {0: 0, 1: 0}, 6, ASKING, [(12, "stopped")], False)
    assert text == (
        "engines 0,1 did not answer within 6 s (%dist_start --timeout 6) when nbdist asked "
        "each for its host, address and devices: engines 0,1 hold nbdist's request alone; the "
        "one process of theirs here (pid 12) is stopped (SIGSTOP, or Ctrl-Z in its terminal). "
        "nbdist took its request back."
    )


def test_a_busy_engine_keeps_its_count_beside_its_processs_state():
    text = silent_engines_message([2], {2: 1}, 4, ASKING, [(30, "sleeping")])
    assert text == (
        "engine 2 did not answer within 4 s (%dist_start --timeout 4) when nbdist asked it "
        "for its host, address and devices: it is running other work (1 request before "
        "nbdist's): let that finish or interrupt it, then start again; its process here (pid "
        "30) is asleep, waiting on something (a lock, a socket, native code, or a request that "
        "never reached it): `py-spy dump --pid 30` shows where. nbdist took its request back."
    )
