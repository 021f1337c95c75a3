"""Kernel side: the lines a session prints once its ranks are ready (``%dist_start``, ``%dist_restart``).

Ranks, hosts, backend and devices, how long the start (or restart) took and what
a restart kept, then the placement's notes (ranks sharing a GPU, threads per rank) and the group's
(gloo connecting lazily, :meth:`nbdist.driver.group.Group.notes`).
"""

from __future__ import annotations

__all__ = ["ready_lines"]


def ready_lines(session) -> str:
    """The running ``session``'s summary (:meth:`nbdist.driver.session.DistSession.summary`)."""
    ranks = session.ranks
    devices = ", ".join(sorted({r.device for r in ranks}))
    hosts = sorted({r.host for r in ranks})
    where = f" on {len(hosts)} hosts" if len(hosts) > 1 else ""
    what = f"backend {session.backend} · device {devices}"
    restarted = session.restarted
    if restarted is not None:
        if restarted.fresh:
            how = f"full restart: {restarted.note}; " if restarted.note else ""
            how += "fresh processes: names defined in cells are gone"
        else:
            how = f"{restarted.note}; the same processes: names defined in cells are kept"
        line = (
            f"nbdist: restarted {len(ranks)} ranks{where} in {restarted.seconds:.1f} s · {what} "
            f"({how})"
        )
    elif session.startup_seconds is None:  # attached to ranks another kernel started
        line = f"nbdist: {len(ranks)} ranks ready{where} · {what} · attached"
    else:
        start_note = session.cluster.start_note
        line = (
            f"nbdist: {len(ranks)} ranks ready{where} · {what} · "
            f"{session.startup_seconds:.1f} s{f'; {start_note}' if start_note else ''}"
        )
    placement = session.placement
    notes = [placement.sharing_note(), placement.threads_note()] if placement else []
    if session.group is not None:
        notes += session.group.notes()
    return "\n".join([line, *(f"nbdist: {note}" for note in notes if note)])
