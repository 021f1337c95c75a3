"""Kernel side: %dist_debug (post-mortem pdb on a rank), %dist_debugpy and the other debugging magics.

Registered by :func:`nbdist.magics.register`; each magic parses its line and
calls the library (:mod:`nbdist.driver.debugging`,
:mod:`nbdist.engine.debugpy_server`). How debugging on the ranks works, with
a worked session: docs/debugging.md.
"""

from __future__ import annotations

import sys
import traceback

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import RankError
from nbdist.magics.args import SessionMagics, asked_for_help, parse_magic_line

__all__ = ["DebugMagics"]


@magics_class
class DebugMagics(SessionMagics):
    """%dist_debug, %dist_debugpy, %dist_last_error: on the session ``self.dist`` holds."""

    @magic_arguments()
    @argument("--rank", default=None, help="the rank to debug (default: the one that failed)")
    @line_magic
    def dist_debug(self, line=""):
        """Post-mortem pdb on the frame where the last failed cell raised, on the rank that failed.

        The debugger runs on the rank; its prompt, ``(Pdb rank 1)``, is the
        notebook's input box (Jupyter's stdin channel) and its output streams
        into the cell. ``p z``, ``up``, ``ll``, ``w`` work as in pdb; ``q`` leaves
        it and the ranks are ready for the next cell. Without --rank: the lowest
        rank whose own error failed the last failed cell (ranks released from a
        collective because of it are not chosen; --rank R picks any rank, e.g.
        to see where a released rank was waiting). Example::

            %%on_all_ranks
            def f(z):
                return 1 / (z - rank)
            f(1)                      # ZeroDivisionError on rank 1

            %dist_debug
            # post-mortem of rank 1: ZeroDivisionError: division by zero
            # (Pdb rank 1) p z
            # [rank 1] 1

        A front end without stdin (nbclient or nbconvert without allow_stdin,
        papermill) gets an error at once, and the rank keeps its error. Breakpoints (``breakpoint()`` in a
        cell) use the same path; see docs/debugging.md.
        """
        from nbdist.driver.debugging import failed_rank, post_mortem_on_rank
        from nbdist.launch.values import is_digits

        if asked_for_help(self.dist_debug, line):
            return
        if is_digits(line.strip()):  # %dist_debug 1: the flag left out
            raise UsageError(
                f"%dist_debug {line.strip()!r}: name the rank with --rank, "
                f"e.g. %dist_debug --rank {line.strip()}"
            )
        args = parse_magic_line(self.dist_debug, line)
        session = self.dist.running_session()
        # The error IPython showed last, as its own %debug uses it (through a refusal of
        # ours, below: the error it was refused for).
        last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        refused = getattr(self, "_refused", None)
        if refused is not None and last is refused[0]:
            last = refused[1]
        if args.rank is not None:
            if not is_digits(args.rank) or int(args.rank) >= session.world_size:
                raise UsageError(
                    f"--rank {args.rank!r}: give a rank of this cluster, 0..{session.world_size - 1}"
                )
            rank = int(args.rank)
        else:
            rank = failed_rank(last)
            if rank is None:
                raise UsageError(
                    "%dist_debug: the last error was not a failed cell on the ranks; "
                    "name a rank to debug its last failed cell, e.g. %dist_debug --rank 1"
                )
        from nbdist.driver.prompts import stdin_attached

        if not stdin_attached():
            # Refused before the rank runs anything: a post-mortem failing there would become
            # the rank's last error, in place of the one to debug. This refusal becomes the
            # kernel's last error: the next %dist_debug looks through it.
            refusal = UsageError(
                f"%dist_debug: this front end sends no input (nbclient, nbconvert, papermill): "
                f"nobody could answer pdb on rank {rank}; its error is kept for a %dist_debug "
                "from JupyterLab, Notebook or a terminal"
            )
            self._refused = (refusal, last)
            raise refusal
        post_mortem_on_rank(session, rank)

    @magic_arguments()
    @argument("rank", help="the rank to debug")
    @argument("--port", default="0", help="the port to listen on (default 0: a free one)")
    @argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default loopback; any other is reachable from the network)",
    )
    @line_magic
    def dist_debugpy(self, line=""):
        """Start debugpy listening on one rank and print how to attach a debugger to it.

        debugpy listens on loopback (127.0.0.1) on RANK's host, on --port (0,
        the default: a free port the OS picks); the address, a VS Code
        ``launch.json`` configuration ("type": "debugpy", "request": "attach")
        and, for a rank on another host, the SSH tunnel to open are printed.
        Calling it again on the same rank shows the same listener (debugpy
        listens once per process). Cells keep running while nobody is
        attached; a breakpoint set in the debugger, in a .py file the rank
        imports, stops that rank when a later cell reaches it, and the cell
        waits until the debugger continues (or detaches). Code typed in a cell
        has no file to set a breakpoint in: ``breakpoint()`` there opens pdb in
        the notebook instead (%dist_debug?). Example::

            %dist_debugpy 1
            # rank 1: debugpy listening on 127.0.0.1:43517 (pid 8120)
            # VS Code (Python Debugger extension): add this to .vscode/launch.json's ...

            %%on_all_ranks --noblock
            loss = train_step(model, batch)   # rank 1 stops at your breakpoint

        JupyterLab's debugger debugs the notebook's own kernel and cannot
        attach to a port: use VS Code, or another Debug Adapter Protocol client
        that attaches to a debugpy server by host and port. --host 0.0.0.0
        listens on every interface (a warning says so): whoever reaches the port
        can run any code on the rank. See docs/debugging.md.
        """
        from nbdist.engine import debugpy_server
        from nbdist.engine.netif import is_loopback
        from nbdist.launch.values import is_digits

        if asked_for_help(self.dist_debugpy, line):
            return
        args = parse_magic_line(self.dist_debugpy, line)
        session = self.dist.running_session()
        if not is_digits(args.rank) or int(args.rank) >= session.world_size:
            raise UsageError(
                f"rank {args.rank!r}: give a rank of this cluster, 0..{session.world_size - 1}"
            )
        if not is_digits(args.port) or int(args.port) > 65535:
            raise UsageError(
                f"--port {args.port!r}: give a TCP port, 1..65535, or 0 for a free one"
            )
        rank, port = int(args.rank), int(args.port)
        try:
            endpoint = session.apply(debugpy_server.listen, port, args.host, ranks=[rank])[0]
        except RankError as exc:  # debugpy could not bind: the port or the address is the problem
            why = exc.failures[0].evalue
            if not why.startswith("Can't listen"):
                raise
            raise UsageError(
                f"%dist_debugpy: rank {rank} cannot listen on {args.host}:{port} "
                f"({why.partition(': ')[2] or why}): --port 0 picks a free port; --host must "
                "be an address of the rank's host (default 127.0.0.1)"
            ) from None
        # Warned once it listens, on the address it listens on (a rank listens once: asked
        # again, it keeps its first address); an address it cannot take gets no warning.
        host = endpoint.get("host")
        if host and not is_loopback(host):
            print(
                f"warning: debugpy on rank {rank} listens on {host}, beyond loopback: "
                "anyone who can reach that port can run any code on the rank (debugpy asks "
                "for no password); an SSH tunnel to 127.0.0.1 is the safe way in",
                file=sys.stderr,
            )
        print(debugpy_server.attach_text(endpoint))

    @magic_arguments()
    @argument(
        "--full",
        action="store_true",
        help="the whole kernel-side traceback, nbdist's frames included, and every rank's own",
    )
    @line_magic
    def dist_last_error(self, line=""):
        """Show the last error of this kernel again; --full with every frame.

        nbdist's errors (a cell's ``--timeout``, a dead rank, a bad placement)
        print what happened and what to do, without the frames of nbdist's own
        magics and waits in between. ``--full`` prints those frames, and for a
        failed cell each failing rank's traceback (not grouped), e.g. for a bug
        report. Example::

            %%on_all_ranks --timeout 5
            ...                      # CellTimeout: the cell ran longer than --timeout 5 s ...

            %dist_last_error --full
        """
        from nbdist.errors import RankError, RanksInterrupted

        if asked_for_help(self.dist_last_error, line):
            return
        args = parse_magic_line(self.dist_last_error, line)
        error = getattr(sys, "last_value", None)
        if error is None:
            print("no error yet in this kernel")
            return
        if not args.full:
            render = getattr(error, "_render_traceback_", None)
            lines = render() if render else traceback.format_exception_only(type(error), error)
            print("\n".join(x.rstrip("\n") for x in lines))
            return
        print("".join(traceback.format_exception(type(error), error, error.__traceback__)))
        ranks = error.stopped if isinstance(error, RanksInterrupted) else error
        if isinstance(ranks, RankError):
            for failure in ranks.failures:
                print(f"--- rank {failure.rank} ---")
                print(failure.traceback)
