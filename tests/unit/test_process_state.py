"""What a process here is doing, read from the process table: a real child, stopped,
continued and ended; and the words of several states at once."""

from __future__ import annotations

import doctest
import signal
import subprocess
import sys
import time

import psutil

import nbdist.driver.process_state
from nbdist.driver.process_state import (
    process_here,
    process_state_of,
    process_states,
    ranks_in_words,
    states_in_words,
    stopped_in_words,
)


def _settles(proc: psutil.Process, state: str) -> str:
    # A signal's effect shows in the process table a moment after kill() returns.
    deadline = time.monotonic() + 10
    while (seen := process_state_of(proc)) != state and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


def test_the_modules_examples_hold():
    failed, tried = doctest.testmod(nbdist.driver.process_state)
    assert tried >= 3 and failed == 0


def test_a_child_reads_asleep_then_stopped_then_ended():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (proc,) = process_here(child.pid)
        assert _settles(proc, "sleeping") == "sleeping"
        child.send_signal(signal.SIGSTOP)
        assert _settles(proc, "stopped") == "stopped"
        assert process_states([proc]) == [(child.pid, "stopped")]
        child.send_signal(signal.SIGCONT)
        assert _settles(proc, "sleeping") == "sleeping"
    finally:
        child.kill()
    assert _settles(proc, "ended") == "ended"  # a zombie until reaped: ended already
    child.wait()
    assert process_state_of(proc) == "ended"
    assert process_here(child.pid) == []


def test_several_states_are_grouped_and_each_fix_named_once():
    text = states_in_words([(7, "disk-sleep"), (5, "running"), (9, "disk-sleep")], of=3)
    assert text == (
        "their processes here: pids 7,9 are in uninterruptible wait, mostly for the disk "
        "(swapping, slow or hung storage): `free -h` shows the swap in use; pid 5 is running, "
        "in native code or starved of CPU on a loaded machine: `top` shows which; "
        "`py-spy dump --pid 5` shows where"
    )


def test_without_the_processes_afterwards_no_command_is_named():
    text = states_in_words([(3, "sleeping"), (4, "ended")], of=2, stay=False)
    assert text == (
        "their processes here: pid 3 is asleep, waiting on something (a lock, a socket, "
        "native code, or a request that never reached it); pid 4 has ended"
    )


def test_one_process_of_several_silent_engines_is_not_called_theirs_alone():
    text = states_in_words([(8, "tracing-stop")], of=2)
    assert (
        text
        == "the one process of theirs here (pid 8) is held by a debugger or tracer attached to it"
    )


def test_many_ranks_of_one_state_are_named_without_their_pids():
    entries = [(r, 100 + r, "sleeping") for r in range(6)] + [(6, 7, "stopped")]
    text = ranks_in_words(entries)
    assert text == (
        "the processes here of ranks 0-5 are asleep, waiting on something (a lock, a socket, "
        "native code, or a request that never reached it); the process here of rank 6 (pid 7) "
        "is stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT 7` lets it go on"
    )


def test_a_few_ranks_of_one_state_are_named_with_their_pids_and_one_command():
    text = ranks_in_words([(2, 12, "stopped"), (3, 13, "stopped")])
    assert text == (
        "the processes here of ranks 2-3 (pids 12,13) are stopped (SIGSTOP, or Ctrl-Z in their "
        "terminal): `kill -CONT 12 13` lets them go on"
    )


def test_only_stopped_and_traced_ranks_are_picked_out_and_named_together():
    entries = [(0, 10, "sleeping"), (3, 13, "tracing-stop"), (2, 12, "stopped"), (1, 11, "running")]
    ranks, words = stopped_in_words(entries)
    assert ranks == [2, 3]
    assert words == (
        "the process here of rank 2 (pid 12) is stopped (SIGSTOP, or Ctrl-Z in its terminal): "
        "`kill -CONT 12` lets it go on; the process here of rank 3 (pid 13) is held by a "
        "debugger or tracer attached to it"
    )
    assert stopped_in_words(entries[:1] + entries[3:]) == ([], "")
