"""Kernel side: where the kernel's cells and sessions meet JupyterLab's debugger on the ranks.

The router (:class:`nbdist.driver.lab_debugger.LabDebugRouter`) routes debug
requests; this module puts it in place and feeds it: :func:`install` (once,
at ``%load_ext nbdist``) stands it in front of the kernel's debugger;
:func:`prepare_cell`, before each ``%%on_all_ranks``/``%%on_rank`` cell (and
``%dist_run``) while the debugger is on, starts debugpy on the ranks, tells them
the cell's path (on each engine's control channel, served while the rank still
runs an earlier cell), attaches the router (directly, or relayed for a rank on another machine) and
tells it where each rank runs the files ``%dist_sync`` copied (as the rank says), and,
once the kernel's cell ended, tells the router which ranks are still paused (an
interrupted cell's are interrupted again until they are not);
:func:`session_ended` closes the relays of a stopping session.
"""

from __future__ import annotations

import concurrent.futures
import socket
import sys
import time

from nbdist.driver import kernel_debugpy, lab_debug_watch
from nbdist.driver import rank_debugpy as dap
from nbdist.driver.ipp_internals import send_control
from nbdist.driver.lab_debugger import LabDebugRouter
from nbdist.engine.control import REQUEST
from nbdist.errors import RankError, RanksInterrupted, format_ranks, ranks_text
from nbdist.number_ranges import fold_texts

__all__ = ["install", "prepare_cell", "router", "session_ended"]

_router: list[LabDebugRouter | None] = [None]
# Whether a rank's main thread is paused in debugpy (nbdist.engine.dap_relay).
_PAUSED = {"action": "lab_paused"}
# How long the ranks may take to prepare. A rank's first preparation starts its debugpy
# (in the rank, ~0.1 CPU-s): 256 ranks sharing 2 cores took 17 s, and a machine loaded
# by other work longer. A rank prepared before answers at once.
PREPARE_TIMEOUT_S = 45.0
# A rank still paused in an interrupted cell is interrupted again this many times, each
# given this long to leave the pause.
_UNPAUSE_TRIES = 3
_UNPAUSE_WAIT_S = 2.0
# What a cell that interrupted its ranks raises: the kernel's interrupt (RanksInterrupted),
# its --timeout (CellTimeout), a rank's failure that released the others (RankError). A
# cell that failed before it ran (a dead rank) interrupted nothing: a --noblock cell's
# ranks paused meanwhile stay paused.
_INTERRUPTED_RANKS = (RanksInterrupted, TimeoutError, RankError)


def router() -> LabDebugRouter | None:
    """This kernel's router, once :func:`install` put it in place."""
    return _router[0]


def install(ipython) -> LabDebugRouter | None:
    """Route ``ipython``'s kernel's debug requests through a :class:`LabDebugRouter` (once).

    None when there is no ipykernel kernel with a debugger (a terminal IPython).
    """
    kernel = getattr(ipython, "kernel", None)
    if kernel is None or getattr(kernel, "debugger", None) is None:
        return None
    if _router[0] is not None and _router[0].kernel is kernel:
        return _router[0]
    found = LabDebugRouter(kernel)
    found.adopt(kernel.debugger)
    kernel_debugpy.leave_children_alone()
    kernel.do_debug_request = found.handle
    _router[0] = found
    return found


def prepare_cell(session, ranks, body: str) -> None:
    """Before a ``%%on_all_ranks``/``%%on_rank`` cell (or ``%dist_run``): when JupyterLab's
    debugger is on, make its breakpoints stop the ranks.

    ``body``: what the magic runs on ``ranks``. Does nothing while the debugger
    is off. Every time, debugpy is started on the ranks and the router attached
    to it, so breakpoints in files (a ``%dist_run`` script, an imported module)
    stop them. The cell's own gutter breakpoints need the cell's lines: when its
    notebook text is not the magic line then ``body`` (a call from a script, a
    cell IPython transformed), the ranks run it without them, and a cell magic's
    cell says so in its output.
    """
    found = router()
    if found is None or not found.active:
        return
    source = ((found.kernel.get_parent("shell") or {}).get("content") or {}).get("code", "")
    path, offset = _cell_lines(source, body)
    if path is None and source.lstrip().startswith("%%"):
        print(
            "nbdist: JupyterLab's debugger cannot match this cell's lines to the notebook's "
            "cell: breakpoints in its gutter do not stop the ranks (breakpoints in files do)",
            file=sys.stderr,
        )
    _watch_cell_end(found, session, ranks)
    endpoints = _prepare_ranks(found, session, ranks, (body, path, offset, source))
    # Before attaching: a rank attached now gets its breakpoints at its copies' paths too.
    found.use_copies({r: e.get("copies") or {} for r, e in endpoints.items()})
    from nbdist.engine import lab_debug

    here = set(lab_debug.machine_addresses())
    engines = {r.rank: r.engine_id for r in getattr(session, "ranks", ())}
    targets = []
    for rank, endpoint in endpoints.items():
        if endpoint.get("port") is None or found.attached(rank, endpoint):
            continue
        addresses = set(endpoint.get("addresses") or ())
        relay = None
        if endpoint.get("hostname") != socket.gethostname() or (
            addresses and here and not addresses & here
        ):
            # Its loopback is not this kernel's: through the engine's control channel.
            relay = (session.client, engines[rank])
        targets.append((rank, endpoint["host"], endpoint["port"], endpoint.get("pid"), relay))
    failed = found.connect(targets)
    for ranks_alike, why in _alike(failed):
        found.tell(
            ranks_alike,
            [endpoints[r] for r in ranks_alike],
            f"nbdist: JupyterLab's debugger could not attach to {ranks_text(ranks_alike)} "
            f"({why}); breakpoints do not stop {_them(ranks_alike)}, the other ranks stop as usual",
        )


def _alike(failures: dict[int, Exception]) -> list[tuple[list[int], str]]:
    # 256 ranks the debugger could not reach on a loaded machine are one line, not 256;
    # the reasons that name their rank (or port) too, with ranges.
    return fold_texts({rank: str(exc) for rank, exc in failures.items()})


def _them(ranks: list[int]) -> str:
    return "it" if len(ranks) == 1 else "them"


def _cell_lines(source: str, body: str) -> tuple[str | None, int]:
    """(the path JupyterLab knows the cell ``source`` by, lines above ``body`` in it), or
    (None, 0) when ``body`` is not the end of ``source``."""
    # IPython ends the body it hands a cell magic with a newline the notebook's text may
    # lack, and drops a last line of spaces (JupyterLab's indent after a block) that the
    # notebook's text keeps: trailing whitespace does not count.
    text, code = source.rstrip(), body.rstrip()
    if not text or not code or not text.endswith(code):
        return None, 0
    from ipykernel.compiler import get_file_name

    return get_file_name(source), text[: len(text) - len(code)].count("\n")


def _watch_cell_end(found: LabDebugRouter, session, ranks) -> None:
    events = found.kernel.shell.events
    # Ranks that pause without their debugpy saying so are shown stopped all the same.
    silent = lab_debug_watch.watch(found, lambda r: _ask_ranks(session, r, _PAUSED), ranks)

    def ended(result=None):
        silent.set()
        events.unregister("post_run_cell", ended)
        marked = found.stopped_among(ranks)
        paused: set[int] = set()
        if isinstance(getattr(result, "error_in_exec", None), _INTERRUPTED_RANKS):
            # The cell interrupted its ranks: none may stay paused in it.
            paused = _unpause_interrupted(found, session, ranks)
            found.cell_ended(ranks, still_paused=paused)
            return
        if marked:
            # The cell returned while ranks it ran on were paused: a --noblock cell, whose
            # ranks run on (paused ones stay paused). Each says whether it still is.
            paused = _paused(session, marked)
        # Only the ranks asked: one that stopped meanwhile (a --noblock cell's rank reaching
        # its breakpoint while the others answered) is paused, and was once shown running.
        found.cell_ended(marked, still_paused=paused)

    found.cell_started(ranks)
    events.register("post_run_cell", ended)


def _paused(session, ranks) -> set[int]:
    """Those of ``ranks`` (alive) whose main thread is paused in debugpy, as each says."""
    answers = _ask_ranks(session, ranks, _PAUSED)
    return {r for r, a in answers.items() if isinstance(a, dict) and a.get("paused")}


def _unpause_interrupted(found: LabDebugRouter, session, ranks) -> set[int]:
    """After a cell that interrupted its ranks: SIGINT again those still paused in it; those
    that stay paused (shown stopped, and named) are returned.

    The interrupt raises KeyboardInterrupt where a paused rank waits in debugpy; one that
    lands while debugpy handles a request there is swallowed by debugpy, and the rank stays
    paused in the cell that ended in the kernel: the next cell would wait behind it, with
    the rank shown running.
    """
    dead = session.dead_ranks(among=ranks)
    attached = set(found.connected())
    stuck = _paused(session, [r for r in ranks if r in attached and r not in dead])
    for _ in range(_UNPAUSE_TRIES):
        if not stuck:
            break
        session.interrupt(sorted(stuck))
        deadline = time.monotonic() + _UNPAUSE_WAIT_S
        while stuck and time.monotonic() < deadline:
            time.sleep(0.1)
            stuck = _paused(session, sorted(stuck))
    if stuck:
        print(
            f"nbdist: {format_ranks(sorted(stuck))} stayed paused in the debugger after the "
            "interrupt: Continue in JupyterLab's debugger ends the cell there (or "
            "%dist_restart)",
            file=sys.stderr,
        )
    return stuck


def _ask_ranks(
    session, ranks, content: dict, timeout: float = dap.CONNECT_TIMEOUT_S
) -> dict[int, dict | Exception]:
    """{rank: its ``dap`` answer to ``content``, or the exception} asked on each rank's
    control channel (:mod:`nbdist.engine.dap_relay`), all at once, waited for up to
    ``timeout`` seconds."""
    engines = {r.rank: r.engine_id for r in getattr(session, "ranks", ())}
    answers: dict[int, dict | Exception] = {}
    asked = {}
    for rank in ranks:
        try:
            asked[rank] = send_control(session.client, engines[rank], REQUEST, content)
        except Exception as exc:  # noqa: BLE001 - the rank is gone, or the session stopped
            answers[rank] = exc
    concurrent.futures.wait(asked.values(), timeout=timeout)
    for rank, future in asked.items():
        try:
            msgs = future.result(timeout=0)
            reply = (msgs[0] if isinstance(msgs, list) else msgs)["content"]
            if reply.get("status") != "ok":
                raise RuntimeError(f"{reply.get('ename')}: {reply.get('evalue')}")
            answers[rank] = reply["dap"]
        except concurrent.futures.TimeoutError:
            answers[rank] = TimeoutError(f"no answer within {timeout:g} s")
        except Exception as exc:  # noqa: BLE001 - that rank's answer is its error
            answers[rank] = exc
    return answers


def _prepare_ranks(found, session, ranks, cell) -> dict[int, dict]:
    """{rank: its debugpy endpoint} (:func:`nbdist.engine.lab_debug.prepare`), asked on each
    rank's control channel: served at once also while the rank runs or is paused in an
    earlier cell (a request queued behind it would hold this cell before its
    ``--timeout`` starts). A rank that does not answer is named and left out, as is a dead
    rank (the cell itself says it died)."""
    body, path, offset, source = cell
    content = {
        "action": "lab_prepare",
        "body": body if path is not None else None,
        "path": path,
        "offset": offset,
        "source": source,
    }
    endpoints: dict[int, dict] = {}
    # A dead rank never answers: the whole window would pass before the cell says it died.
    dead = session.dead_ranks(among=ranks)
    alive = [r for r in ranks if r not in dead]
    failed = {}
    for rank, answer in _ask_ranks(session, alive, content, PREPARE_TIMEOUT_S).items():
        if isinstance(answer, Exception):
            failed[rank] = answer
        else:
            endpoints[rank] = answer
    for ranks_alike, why in _alike(failed):
        found.tell(
            ranks_alike,
            [{}] * len(ranks_alike),
            f"nbdist: JupyterLab's debugger could not prepare {ranks_text(ranks_alike)} ({why}); "
            f"breakpoints do not stop {_them(ranks_alike)} in this cell",
        )
    return endpoints


def session_ended(client) -> None:
    """A session's ranks are stopping (``%dist_stop``, ``%dist_restart``) and ``client``, its
    ipyparallel client, is about to close: the debugger's relays through it close first, so
    ranks that outlive the session (a cluster it connected to) are left undebugged."""
    found = router()
    if found is not None:
        found.leave_relayed(client)
