"""Kernel side: what a process on this machine is doing, in words for an error.

When an engine keeps nbdist waiting, what it is doing decides the fix: a stopped
process needs a SIGCONT, one in disk wait a machine that is not swapping, one
asleep or running in native code a look at its stack. The kernel reads that from
the process table (psutil: ``/proc/<pid>/stat`` on Linux) instead of listing every
cause it might be.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import psutil

from nbdist.errors import format_ranks

__all__ = [
    "STOPPED_STATES",
    "process_here",
    "process_state_of",
    "process_states",
    "ranks_in_words",
    "state_phrase",
    "states_in_words",
    "stopped_in_words",
]

# Above this many ranks of one state, their PIDs (and a command over them) are left out.
_NAMED_PIDS = 4

ENDED = "ended"
# The states in which a process cannot take a signal, nor answer, until it is continued.
STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

# What each state means for an engine that holds a request and does not answer, and, for a
# process that is still there after the error, what to do or what shows more. "Asleep"
# includes an engine idle in its own loop: the request never reached it.
_WORDS = {
    psutil.STATUS_STOPPED: (
        "is stopped (SIGSTOP, or Ctrl-Z in its terminal)",
        "`kill -CONT {pid}` lets it go on",
    ),
    psutil.STATUS_TRACING_STOP: ("is held by a debugger or tracer attached to it", ""),
    psutil.STATUS_DISK_SLEEP: (
        "is in uninterruptible wait, mostly for the disk (swapping, slow or hung storage)",
        "`free -h` shows the swap in use",
    ),
    psutil.STATUS_SLEEPING: (
        "is asleep, waiting on something (a lock, a socket, native code, or a request that "
        "never reached it)",
        "`py-spy dump --pid {pid}` shows where",
    ),
    psutil.STATUS_RUNNING: (
        "is running, in native code or starved of CPU on a loaded machine",
        "`top` shows which; `py-spy dump --pid {pid}` shows where",
    ),
    ENDED: ("has ended", ""),
}


def process_state_of(proc: psutil.Process) -> str:
    """``proc``'s state (psutil's word: 'stopped', 'sleeping', 'disk-sleep', ...) or 'ended'.

    A process whose PID now names another one (psutil compares start times) has ended.
    """
    try:
        if not proc.is_running():
            return ENDED
        state = proc.status()
    except psutil.Error:
        return ENDED
    return ENDED if state in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else state


def process_here(pid: int) -> list[psutil.Process]:
    """The process ``pid`` names on this machine (a list of one), or none if it has ended."""
    try:
        return [psutil.Process(pid)]
    except psutil.Error:
        return []


def process_states(procs: Sequence[psutil.Process]) -> list[tuple[int, str]]:
    """``(pid, state)`` of each of ``procs``, in PID order."""
    return sorted((proc.pid, process_state_of(proc)) for proc in procs)


def states_in_words(states: Sequence[tuple[int, str]], *, of: int = 1, stay: bool = True) -> str:
    """``states`` (from :func:`process_states`) of ``of`` engines' processes, as a clause.

    ``stay``: whether the processes outlive the error (an attached cluster's engines do;
    those of a failed start are stopped with it): only then does it say what to run on them.

    >>> print(states_in_words([(41, "stopped")]))
    its process here (pid 41) is stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT 41` lets it go on
    >>> print(states_in_words([(41, "stopped")], stay=False))
    its process here (pid 41) is stopped (SIGSTOP, or Ctrl-Z in its terminal)
    >>> print(states_in_words([(41, "stopped"), (42, "stopped"), (43, "sleeping")], of=3))
    their processes here: pids 41,42 are stopped (SIGSTOP, or Ctrl-Z in their terminal): `kill -CONT 41 42` lets them go on; pid 43 is asleep, waiting on something (a lock, a socket, native code, or a request that never reached it): `py-spy dump --pid 43` shows where
    """
    words = functools.partial(_words, stay=stay)
    by_state: dict[str, list[int]] = {}
    for pid, state in states:
        by_state.setdefault(state, []).append(pid)
    if len(states) == 1:
        ((pid, state),) = states
        whose = "its process here" if of == 1 else "the one process of theirs here"
        return f"{whose} (pid {pid}) {words(state, [pid])}"
    parts = []
    for state, pids in by_state.items():
        if len(pids) == 1:
            parts.append(f"pid {pids[0]} {words(state, pids)}")
        else:
            parts.append(f"pids {','.join(map(str, pids))} {_plural(words(state, pids))}")
    return "their processes here: " + "; ".join(parts)


def ranks_in_words(entries: Sequence[tuple[int, int, str]], *, stay: bool = True) -> str:
    """``(rank, pid, state)`` of ranks' processes here, as a clause, the ranks of a state together.

    ``stay``: as for :func:`states_in_words`.

    >>> print(ranks_in_words([(1, 51, "stopped"), (0, 50, "sleeping")], stay=False))
    the process here of rank 0 (pid 50) is asleep, waiting on something (a lock, a socket, native code, or a request that never reached it); the process here of rank 1 (pid 51) is stopped (SIGSTOP, or Ctrl-Z in its terminal)
    """
    by_state: dict[str, list[tuple[int, int]]] = {}
    for rank, pid, state in sorted(entries):
        by_state.setdefault(state, []).append((rank, pid))
    parts = []
    for state, members in by_state.items():
        ranks = [rank for rank, _pid in members]
        pids = [pid for _rank, pid in members]
        if len(members) == 1:
            parts.append(
                f"the process here of rank {ranks[0]} (pid {pids[0]}) "
                f"{_words(state, pids, stay=stay)}"
            )
        elif len(members) <= _NAMED_PIDS:
            parts.append(
                f"the processes here of {format_ranks(ranks)} (pids {','.join(map(str, pids))}) "
                f"{_plural(_words(state, pids, stay=stay))}"
            )
        else:
            parts.append(
                f"the processes here of {format_ranks(ranks)} "
                f"{_plural(_words(state, pids, stay=False))}"
            )
    return "; ".join(parts)


def stopped_in_words(
    entries: Sequence[tuple[int, int, str]], *, stay: bool = True
) -> tuple[list[int], str]:
    """Of ``(rank, pid, state)`` entries, the ranks whose process is stopped (SIGSTOP, a
    tracer), and those processes as :func:`ranks_in_words` says them ('' if none is).

    >>> stopped_in_words([(0, 50, "sleeping"), (1, 51, "stopped")])
    ([1], 'the process here of rank 1 (pid 51) is stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT 51` lets it go on')
    """
    stopped = [entry for entry in entries if entry[2] in STOPPED_STATES]
    words = ranks_in_words(stopped, stay=stay) if stopped else ""
    return sorted(rank for rank, _pid, _state in stopped), words


def state_phrase(state: str) -> str:
    """What a process in ``state`` is doing, without its PID or a command: the same for every
    rank in that state, so a report groups them ("is stopped (SIGSTOP, ...)").

    >>> state_phrase("disk-sleep")
    'is in uninterruptible wait, mostly for the disk (swapping, slow or hung storage)'
    """
    return _WORDS.get(state, (f"is in state {state!r}", ""))[0]


def _words(state: str, pids: list[int], *, stay: bool) -> str:
    what, then = _WORDS.get(state, (f"is in state {state!r}", ""))
    if not (stay and then):
        return what
    return f"{what}: {then.replace('{pid}', ' '.join(map(str, pids)))}"


def _plural(text: str) -> str:
    # The singular phrases above, said of several processes of one state.
    text = text.replace("is ", "are ", 1).replace("has ended", "have ended")
    text = text.replace("in its terminal", "in their terminal")
    return text.replace("lets it go on", "lets them go on")
