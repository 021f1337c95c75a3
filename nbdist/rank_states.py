"""Kernel and Jupyter server: the one vocabulary of rank states every view uses.

``%dist_status`` (:meth:`nbdist.DistSession.status`), the dashboard's rank table,
the sidebar's REST API and the JupyterLab status bar all name a rank's state
with these words, and a dead rank is dead in every one of them:

``idle``
    alive, running no cell.
``busy``
    alive and running a cell (or, where only the operating system and the
    run history can be read, as in the Jupyter server: using CPU, or logging).
``dead``
    its process ended, or its engine stopped answering the controller; it
    stays dead until ``%dist_restart``.

A live rank whose process here can run nothing until someone acts is ``idle`` or
``busy`` all the same (the controller's word), and *held*: ``stopped`` (SIGSTOP,
Ctrl-Z) or ``held by a debugger`` (gdb, a tracer attached). The dashboard's table
and the sidebar show it beside the state ("idle · stopped"); ``%dist_status`` says
it in words with what lets it go on. A session's states carry it as
:class:`HeldState`, equal to the state word, so every count by state still holds; a count
says the held among it (:func:`counts_in_words`: ``3 busy (1 stopped)``).

Example::

    >>> from nbdist.rank_states import BUSY, RANK_STATES
    >>> BUSY in RANK_STATES
    True
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "BUSY",
    "DEAD",
    "HELD",
    "IDLE",
    "RANK_STATES",
    "STOPPED",
    "HeldState",
    "counts_in_words",
    "held_counts",
    "held_word",
]

IDLE = "idle"
BUSY = "busy"
DEAD = "dead"
RANK_STATES = (IDLE, BUSY, DEAD)

STOPPED = "stopped"
HELD = "held by a debugger"
# psutil's status words (``/proc/<pid>/stat``) of the processes that are held.
_HOLDS = {"stopped": STOPPED, "tracing-stop": HELD}


def held_word(status: str) -> str:
    """:data:`STOPPED` or :data:`HELD` for psutil's ``status`` word of a held process, else ''.

    >>> held_word("tracing-stop"), held_word("sleeping")
    ('held by a debugger', '')
    """
    return _HOLDS.get(status, "")


class HeldState(str):
    """A live rank's state word (``idle``, ``busy``) whose process here is held: equal to
    the word, so counts and comparisons by state are unchanged; :attr:`held` says how.

    >>> state = HeldState(IDLE, STOPPED)
    >>> state == IDLE, state.held
    (True, 'stopped')
    """

    held: str

    def __new__(cls, state: str, held: str) -> HeldState:
        """``state`` (one of :data:`RANK_STATES` but ``dead``), ``held`` (:data:`STOPPED` or
        :data:`HELD`)."""
        made = super().__new__(cls, state)
        made.held = held
        return made


def held_counts(pairs: Iterable[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """``{state: {held word: n}}`` of ``(state, held word)`` pairs, those held only.

    >>> held_counts([(BUSY, STOPPED), (BUSY, ""), (IDLE, HELD)])
    {'busy': {'stopped': 1}, 'idle': {'held by a debugger': 1}}
    """
    counts: dict[str, dict[str, int]] = {}
    for state, held in pairs:
        if held and state != DEAD:
            words = counts.setdefault(str(state), {})
            words[held] = words.get(held, 0) + 1
    return counts


def counts_in_words(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """``(state, held word)`` pairs counted by state, busy, idle then dead, the held among
    each said beside it: a held rank counts in its state (the controller's word), as in
    every count by state, and a summary of many ranks says what their own rows would.

    >>> counts_in_words([(BUSY, STOPPED), (BUSY, ""), (DEAD, "")])
    ['2 busy (1 stopped)', '1 dead']
    """
    pairs = list(pairs)
    held = held_counts(pairs)
    words = []
    for state in (BUSY, IDLE, DEAD):
        n = sum(1 for s, _ in pairs if s == state)
        if n:
            inside = ", ".join(f"{k} {word}" for word, k in sorted(held.get(state, {}).items()))
            words.append(f"{n} {state}" + (f" ({inside})" if inside else ""))
    return words
