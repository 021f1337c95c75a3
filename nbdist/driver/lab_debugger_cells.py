"""Kernel side: where the kernel's cells and sessions meet JupyterLab's debugger on the ranks.

The router (:class:`nbdist.driver.lab_debugger.LabDebugRouter`) routes debug
requests; this module puts it in place and feeds it: :func:`install` (once,
at ``%load_ext nbdist``) stands it in front of the kernel's debugger;
:func:`prepare_cell`, before each ``%%on_all_ranks``/``%%on_rank`` cell while
the debugger is on, starts debugpy on the ranks, tells them the cell's path,
attaches the router (directly, or relayed for a rank on another machine) and
tells it where each rank runs the files ``%dist_sync`` copied (as the rank says);
:func:`session_ended` closes the relays of a stopping session.
"""

from __future__ import annotations

import socket

from nbdist.driver import kernel_debugpy
from nbdist.driver.lab_debugger import LabDebugRouter

__all__ = ["install", "prepare_cell", "router", "session_ended"]

_router: list[LabDebugRouter | None] = [None]


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
    """Before a ``%%on_all_ranks``/``%%on_rank`` cell: when JupyterLab's debugger is on, make its
    breakpoints stop the ranks in this cell.

    ``body``: what the magic runs on ``ranks``. Does nothing while the debugger
    is off. A cell whose notebook text is not the magic line then ``body`` (a
    call from a script, a cell IPython transformed) runs without breakpoints.
    """
    found = router()
    if found is None or not found.active:
        return
    from ipykernel.compiler import get_file_name

    from nbdist.engine import lab_debug

    source = ((found.kernel.get_parent("shell") or {}).get("content") or {}).get("code", "")
    # IPython ends the cell it hands a cell magic with a newline the notebook's text may lack.
    text, code = source.rstrip("\n"), body.rstrip("\n")
    if not text or not code or not text.endswith(code):
        return
    offset = text[: len(text) - len(code)].count("\n")
    path = get_file_name(source)
    events = found.kernel.shell.events

    def ended(*_):
        events.unregister("post_execute", ended)
        found.cell_ended(ranks)

    # An interrupt or a failure ends the cell with ranks still marked paused: unmark them.
    events.register("post_execute", ended)
    endpoints = session.apply(lab_debug.prepare, body, path, offset, source, ranks=ranks)
    # Before attaching: a rank attached now gets its breakpoints at its copies' paths too.
    found.use_copies({rank: e.get("copies") or {} for rank, e in zip(ranks, endpoints)})
    here = set(lab_debug.machine_addresses())
    engines = {r.rank: r.engine_id for r in getattr(session, "ranks", ())}
    for rank, endpoint in zip(ranks, endpoints):
        if endpoint.get("port") is None or found.attached(rank, endpoint):
            continue
        addresses = set(endpoint.get("addresses") or ())
        relay = None
        if endpoint.get("hostname") != socket.gethostname() or (
            addresses and here and not addresses & here
        ):
            # Its loopback is not this kernel's: through the engine's control channel.
            relay = (session.client, engines[rank])
        try:
            found.connect(
                rank, endpoint["host"], endpoint["port"], pid=endpoint.get("pid"), relay=relay
            )
        except (OSError, RuntimeError) as exc:
            found.tell(
                [rank],
                [endpoint],
                f"nbdist: JupyterLab's debugger could not attach to rank {rank} ({exc}); "
                "breakpoints do not stop it, the other ranks stop as usual",
            )


def session_ended(client) -> None:
    """A session's ranks are stopping (``%dist_stop``, ``%dist_restart``) and ``client``, its
    ipyparallel client, is about to close: the debugger's relays through it close first, so
    ranks that outlive the session (a cluster it connected to) are left undebugged."""
    found = router()
    if found is not None:
        found.leave_relayed(client)
