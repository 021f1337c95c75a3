"""Kernel side: %dist_sessions and %dist_attach, the magics of named sessions.

Registered by :func:`nbdist.magics.register`; ``%dist_start N --name NAME``
and ``%dist_stop NAME`` live with the other start/stop flags in
:mod:`nbdist.magics.lifecycle` and call :mod:`nbdist.driver.named_sessions` too.
How named sessions work: docs/multihost.md, "Named sessions".
"""

from __future__ import annotations

import time

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import NbdistError
from nbdist.launch.values import parse_duration
from nbdist.magics.args import SessionMagics, asked_for_help, parse_magic_line, seconds
from nbdist.text_table import format_table

__all__ = ["NamedMagics", "format_sessions", "stop_named_session"]


def format_sessions(rows: list[dict]) -> str:
    """The ``%dist_sessions`` table: name, ranks, launcher, started, state, idle, memory, last step.

    ``idle`` is how long no kernel has been attached and no cell has run (``-``
    while one is), with the session's ``--idle-timeout`` after a slash; ``memory``
    what its processes hold on this host; ``gpus`` appears when a session holds any.
    """
    if not rows:
        return "nbdist: no named sessions (start one with %dist_start N --name NAME)"
    gpus = any(row.get("gpus") for row in rows)
    table = []
    for row in rows:
        started = row.get("started")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "-"
        step = row.get("last_step")
        state = row["state"] + (f" ({row['error']})" if row.get("error") else "")
        idle = _duration(row.get("idle_s"))
        if row.get("idle_timeout"):
            idle += f" / {_duration(row['idle_timeout'])}"
        memory = row.get("memory")
        line = [
            row["name"],
            row.get("ranks") or "-",
            row.get("launcher"),
            when,
            state,
            idle,
            f"{memory / 2**30:.2f} GiB" if memory else "-",
        ]
        if gpus:
            line.append(",".join(map(str, row.get("gpus") or [])) or "-")
        table.append([*line, None if step is None else int(step)])
    header = ["name", "ranks", "launcher", "started", "state", "idle", "memory"]
    return format_table([*header, *(["gpus"] if gpus else []), "last step"], table)


def _duration(seconds: float | None) -> str:
    """``-``, ``45 s``, ``12 min``, ``3.5 h``, ``2.0 d``."""
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def stop_named_session(dist_magics, name: str) -> None:
    """``%dist_stop NAME``: end the named session wherever it runs (detaching this kernel first)."""
    from nbdist.driver.named_sessions import stop_named

    session = dist_magics.session
    try:
        if getattr(session, "name", None) == name and session.running:
            n = session.world_size
            session.stop()
        else:
            n = None
            stop_named(name)
    except NbdistError as exc:
        raise UsageError(str(exc)) from None
    print(f"nbdist: stopped session {name!r}" + (f" ({n} ranks)" if n else ""))


@magics_class
class NamedMagics(SessionMagics):
    """%dist_sessions and %dist_attach (named sessions outlive the kernel that started them)."""

    @magic_arguments()
    @argument(
        "--stop-idle",
        default=None,
        metavar="DURATION",
        help="end the sessions idle (no kernel attached, no cell running) this long, e.g. 2h",
    )
    @line_magic
    def dist_sessions(self, line=""):
        """List this user's named sessions: name, ranks, state, idle time, memory, last step.

        A session is idle while no kernel is attached and no cell runs on its
        ranks; ``idle`` shows for how long (and its ``--idle-timeout``, if any).
        ``memory`` is what its processes hold on this host. A session whose keeper
        process is gone (killed) shows as ``gone``; ``%dist_stop NAME`` removes
        what is left of it. Examples::

            %dist_sessions
            # name    ranks  launcher  started              state    idle    memory    last step
            # train1  4      local     2026-11-26 23:10:04  running  3.5 h   2.10 GiB  1200
            %dist_sessions --stop-idle 2h    # ends train1 (and any other idle 2 h or more)
        """
        from nbdist.driver.named_sessions import named_sessions, stop_idle

        if asked_for_help(self.dist_sessions, line):
            return
        args = parse_magic_line(self.dist_sessions, line)
        if args.stop_idle is not None:
            try:
                limit = parse_duration(args.stop_idle, "--stop-idle")
            except NbdistError as exc:
                raise UsageError(str(exc)) from None
            ended = stop_idle(limit)
            which = ", ".join(repr(n) for n in ended)
            print(f"nbdist: stopped {len(ended)} idle session(s)" + (f": {which}" if ended else ""))
        print(format_sessions(named_sessions()))

    @magic_arguments()
    @argument("name", help="the session's name (see %%dist_sessions)")
    @argument("--timeout", default=None, help="seconds to reach the ranks (default: the start's)")
    @line_magic
    def dist_attach(self, line=""):
        """Attach this kernel to a named session started by any kernel (it may have died).

        The ranks keep their namespaces, and the run its metrics (every point,
        also those logged while no kernel was attached). A cell that was running
        when the old kernel died streams the rest of its output here until it
        ends; then the session is this notebook's, as after %dist_start. Examples::

            %dist_attach train1
            %dist_attach train1 --timeout 300   # ranks on a busy machine answer slowly
            %%on_all_ranks
            print(step)              # names defined before are still there
        """
        from nbdist.driver.named_sessions import NamedSession

        if asked_for_help(self.dist_attach, line):
            return
        args = parse_magic_line(self.dist_attach, line)
        # Checked before anything else, so a bad value changes nothing.
        timeout = seconds(args.timeout) if args.timeout is not None else None
        current = self.dist.session
        if current is not None and current.running:
            raise UsageError(
                f"a cluster of {current.world_size} ranks is already running here: "
                "%dist_stop it first (a named one is only detached by a kernel restart)"
            )
        try:
            session = NamedSession.attach(args.name, timeout=timeout)
        except NbdistError as exc:
            raise UsageError(str(exc)) from None
        self.dist.session = session
        print(
            f"nbdist: attached to session {args.name!r} · {session.world_size} ranks · "
            f"backend {session.backend} · run {session.metrics.id}"
        )
        # A cell the old kernel left running: its output here; a rank's error fails this cell.
        session.follow_unfinished()
