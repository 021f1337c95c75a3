"""Rank side: this rank's part in JupyterLab's debugger (the kernel's end is :mod:`nbdist.driver.lab_debugger`).

JupyterLab knows a cell by the path the kernel's ``dumpCell`` gives it (a hash of
the cell's whole source, the ``%%on_all_ranks`` line included); a breakpoint in
the cell's gutter is set on that path and line. The rank runs only the cell's
body, which IPython would compile under a name of its own, numbered from the
body's first line. :func:`prepare` tells the rank, before such a cell, which
path the body belongs to and how many lines lie above it in the notebook's
cell; the rank then compiles that body under the cell's path with its lines
shifted, so the debugger's breakpoints match and its stack frames point into the
notebook's cell.

:func:`prepare` also starts debugpy on the rank the first time (loopback only,
:func:`nbdist.engine.debugpy_server.listen`); nothing is traced before that, so
a session whose notebook never turned the debugger on pays nothing. Once the
debugger is switched off (no client connected), each cell starts untraced again,
so the ranks run at full speed; :func:`prepare` traces them again when it comes
back on.
"""

from __future__ import annotations

import ast
import ipaddress
import linecache
import sys
import threading
import time

from nbdist.engine import debugpy_server, netif, synced_files

__all__ = ["machine_addresses", "on_abandoned_relay", "prepare"]

# Cell bodies the kernel announced: body -> (path, lines above the body, the cell's source).
_cells: dict[str, tuple[str, int, str]] = {}
_MAX_CELLS = 64
# The announced cell IPython is compiling now (set when it names the cell, read when it
# transforms the cell's syntax tree, which follows).
_current: list[tuple[str, int, str] | None] = [None]
_installed: list[bool] = [False]
# Before each cell: closes a relayed debugger connection whose kernel went away, True
# if it did (nbdist.engine.dap_relay's, which sets it: that module uses this one).
_drop_abandoned_relay: list = [lambda: False]
# How long debugpy may take to notice that an abandoned relay's connection closed.
_LEAVE_S = 2.0


class _ShiftLines(ast.NodeTransformer):
    """IPython AST transformer: moves an announced cell's lines to where they sit in the notebook's cell."""

    def visit(self, node):
        hit = _current[0]
        if hit is None:
            return node
        path, offset, source = hit
        _current[0] = None
        if offset:
            ast.increment_lineno(node, offset)
        # Tracebacks and the debugger's source lines read the notebook's cell, line for line.
        lines = source.splitlines(keepends=True)
        linecache.cache[path] = (len(source), None, lines, path)
        return node


def _shell():
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _install(shell) -> None:
    if _installed[0]:
        return
    compiler = shell.compile
    plain = compiler.get_code_name

    def code_name(raw_code, code, number):
        hit = _cells.get(raw_code)
        _current[0] = hit
        return plain(raw_code, code, number) if hit is None else hit[0]

    compiler.get_code_name = code_name
    shell.events.register("pre_execute", _untrace_when_alone)
    shell.events.register("pre_execute", _forget_finished_step)
    shell.ast_transformers.append(_ShiftLines())
    # IPython drops a cell's leading blank lines, which would move every line after them.
    cleanup = shell.input_transformer_manager.cleanup_transforms
    cleanup[:] = [t for t in cleanup if getattr(t, "__name__", "") != "leading_empty_lines"]
    _installed[0] = True


def on_abandoned_relay(check) -> None:
    """Call ``check()`` before each cell: it closes a relayed debugger connection whose
    kernel went away and says whether it did (:func:`nbdist.engine.dap_relay.drop_if_abandoned`)."""
    _drop_abandoned_relay[0] = check


def _untrace_when_alone() -> None:
    # Once the notebook's debugger has let go (switched off), debugpy would go on
    # tracing every line the rank runs (8-20 % of a small training loop's speed on
    # CPU): cells run untraced until the next prepare() traces them again.
    import debugpy

    if _drop_abandoned_relay[0]():
        # A relay whose kernel went away (its session stopped without closing it):
        # its breakpoints must not stop this cell, run for someone else.
        deadline = time.monotonic() + _LEAVE_S
        while debugpy.is_client_connected() and time.monotonic() < deadline:
            time.sleep(0.02)
    if sys.gettrace() is None or debugpy.is_client_connected():
        return
    try:
        # debugpy's own way: sys.settrace itself would print a warning on the rank.
        import pydevd_tracing

        pydevd_tracing.SetTrace(None)
    except (ImportError, RuntimeError):  # a debugpy on sys.monitoring (3.12+) traces no lines
        return
    threading.settrace(None)


def _forget_finished_step() -> None:
    # A Next (or Step Out) off a cell's last line leaves the cell: debugpy, finding no
    # more of the user's code in it (nbdist, IPython and ipyparallel are not), keeps
    # the step pending and would stop at the first line of the rank's next cell, run
    # maybe much later. Likewise a pause left by an interrupt that ended the cell while
    # the rank was paused (debugpy still counts the thread as paused). This thread runs
    # (it runs this hook): whatever step or pause is pending ended with its cell.
    info = getattr(threading.current_thread(), "additional_info", None)
    if info is None:
        return
    try:
        from _pydevd_bundle.pydevd_additional_thread_info import set_additional_thread_info
        from _pydevd_bundle.pydevd_constants import STATE_RUN
        from _pydevd_bundle.pydevd_thread_lifecycle import internal_run_thread
    except ImportError:  # another debugpy layout: what is pending stays
        return
    if getattr(info, "pydev_step_cmd", -1) != -1 or getattr(info, "pydev_state", None) != STATE_RUN:
        internal_run_thread(threading.current_thread(), set_additional_thread_info)


def machine_addresses() -> list[str]:
    """This machine's (network namespace's) addresses that tell it apart: neither loopback
    nor link-local. Two processes that list the same ones share a loopback."""
    found = set()
    for addresses in netif.local_interfaces().values():
        for address in addresses:
            try:
                ip = ipaddress.ip_address(address.partition("%")[0])
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local):
                found.add(str(ip))
    return sorted(found)


def prepare(body: str | None, path: str | None, offset: int, source: str) -> dict:
    """Announce the next cell: compile ``body`` under ``path``, its lines moved down by ``offset``.

    ``source``: the notebook cell's whole text (what the debugger shows for
    ``path``); ``body`` None: no cell to announce (a ``%dist_run`` script, a cell
    whose lines the kernel could not match), only debugpy to start. Starts
    debugpy listening on loopback the first time; returns its endpoint
    (:func:`nbdist.engine.debugpy_server.listen`) with ``addresses``, this
    machine's (:func:`machine_addresses`: the kernel reaches this loopback only
    when it runs on the same machine), and ``copies``, the synced paths this rank
    runs from a copy at another path (:func:`nbdist.engine.synced_files.copies_here`).

    Called on the engine's control thread (:mod:`nbdist.engine.dap_relay`), also
    while the main thread runs or is paused in an earlier cell: the main thread is
    traced again before its next cell (:func:`nbdist.engine.debugpy_server.rearm`).
    """
    shell = _shell()
    if shell is None:
        raise RuntimeError(
            "JupyterLab's debugger needs ranks that run IPython (ipyparallel engines)"
        )
    endpoint = dict(debugpy_server.listen(), addresses=machine_addresses())
    endpoint["copies"] = synced_files.copies_here()
    _install(shell)
    if sys.gettrace() is None and threading.current_thread() is threading.main_thread():
        import debugpy

        debugpy.debug_this_thread()  # traced again after the debugger was off
    if body is not None and path is not None:
        if len(_cells) >= _MAX_CELLS:
            _cells.pop(next(iter(_cells)))
        _cells[body] = (path, int(offset), source)
    return endpoint
