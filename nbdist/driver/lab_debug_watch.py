"""Kernel side: a rank paused in its debugger that did not say so is shown stopped all the same.

JupyterLab learns that a rank stopped from the ``stopped`` event the rank's
debugpy sends (:class:`nbdist.driver.lab_debugger.LabDebugRouter` shows it).
Under load, ranks have been found paused at a breakpoint with no such event
ever reaching the kernel (in about one of twenty runs of the test module that
stops ranks some thirty times; the cause was not found): the cell then waits
for ever, and JupyterLab shows nothing to continue.

While a ranks cell runs with the debugger on, :func:`watch` asks every
:data:`PERIOD_S` seconds each of its ranks that is attached and not shown
stopped whether its main thread is paused in debugpy (``lab_paused`` on the
engine's control channel, :mod:`nbdist.engine.dap_relay`, answered while the
main thread is paused). A rank found paused for :data:`SILENT_S` seconds with
no stop reported is shown stopped in its main thread, reason ``pause``, as if
its debugpy had said so; the Callstack, Continue and
the steps then act on it as on any stopped rank.
"""

from __future__ import annotations

import sys
import threading
import time

from nbdist.driver import rank_debugpy as dap
from nbdist.driver.lab_debug_pause import main_thread

__all__ = ["PERIOD_S", "SILENT_S", "watch"]

# How often the running ranks are asked.
PERIOD_S = 1.0
# How long a rank is found paused with no stop reported before it is shown stopped: a
# stop whose event is on its way (late under load) is not shown twice.
SILENT_S = 3.0


def watch(router, ask_paused, ranks) -> threading.Event:
    """Watch ``ranks`` (those of the kernel's ranks cell) until the returned event is set.

    ``router``: the kernel's :class:`~nbdist.driver.lab_debugger.LabDebugRouter`;
    ``ask_paused(ranks)``: ``{rank: {"paused": bool} or an exception}``, each rank's
    ``lab_paused`` answer.
    """
    done = threading.Event()
    thread = dap.debugger_thread(
        lambda: _run(router, ask_paused, list(ranks), done), "nbdist-lab-debugger-watch"
    )
    thread.start()
    return done


def _run(router, ask_paused, ranks: list[int], done: threading.Event) -> None:
    since: dict[int, float] = {}  # rank -> when it was first found paused, unreported
    while not done.wait(PERIOD_S):
        unseen = router.unreported(ranks)
        if not unseen:
            since = {}
            continue
        answers = ask_paused(unseen)
        now = time.monotonic()
        since = {
            r: since.get(r, now)
            for r, a in answers.items()
            if isinstance(a, dict) and a.get("paused")
        }
        for rank in sorted(r for r, t in since.items() if now - t >= SILENT_S):
            if done.is_set():
                return
            _show(router, rank)


def _show(router, rank: int) -> None:
    try:
        reply = router.ask_now(rank, "threads")
    except Exception as exc:  # noqa: BLE001 - that rank's debugpy is gone: nothing to show
        print(
            f"nbdist: rank {rank} is paused, but its debugger does not answer ({exc})",
            file=sys.stderr,
        )
        return
    main = main_thread(reply)
    if main is not None:
        router.show_stopped(rank, main)
