"""Rank side: debugpy listening on this rank (what ``%dist_debugpy`` starts), and how to attach.

:func:`listen` runs on a rank (the kernel calls it with ``session.apply``): it
starts debugpy listening on loopback (port 0: one the OS picks), inside the rank
(no adapter process), and returns the endpoint as a dict; calling it again returns the same listener. debugpy listens
at most once per process: when other code on the rank already called
``debugpy.listen`` (e.g. ipykernel's own debugger, on a debug request), that
listener is reported instead of failing. :func:`attach_text` (standard library
only, called in the kernel) words an endpoint as what to do in VS Code.

Cells keep running normally while nobody is attached (debugpy traces Python
code from then on: pure-Python loops run slower, torch's kernels do not).
Children the rank starts (DataLoader workers, helpers) are not debugged.
Tensors show their shape, dtype, device and small values in the debugger's
variables (:mod:`nbdist.engine.tensor_view`).

An interrupt (the kernel's, or a cell's ``--timeout``) that lands while the
rank is stopped at a breakpoint raises inside debugpy's trace function, and
CPython then drops that thread's tracing: breakpoints would never stop it
again. :func:`rearm` traces the thread again; it runs before every cell of an
IPython rank (a ``pre_execute`` hook) and on every :func:`listen`. The
KeyboardInterrupt's traceback, which went on through debugpy's own frames, ends at
the cell's line (:mod:`nbdist.engine.traceback_trim`).

Example (a script; ``%dist_debugpy 1`` does the same in a notebook)::

    from nbdist.engine import debugpy_server
    endpoint = session.apply(debugpy_server.listen, ranks=[1])[0]
    print(debugpy_server.attach_text(endpoint))
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

from nbdist.engine import tensor_view
from nbdist.engine.netif import is_loopback

__all__ = ["LOOPBACK", "attach_text", "listen", "listening", "rearm"]

LOOPBACK = "127.0.0.1"

_lock = threading.Lock()
_endpoint: dict | None = None  # what this module's listen() started, once it has


def listening() -> dict | None:
    """The endpoint :func:`listen` started in this process, or None."""
    with _lock:
        return None if _endpoint is None else _described(_endpoint, new=False)


def listen(port: int | None = 0, host: str = LOOPBACK) -> dict:
    """Start debugpy listening on ``(host, port)`` in this process; returns its endpoint.

    ``port`` 0 or None: a free port chosen by the OS. The dict has ``host``,
    ``port`` (None when another caller's listener cannot be read), ``rank``,
    ``pid``, ``hostname``, ``cwd``, ``new`` (False: the listener existed),
    ``owner`` ('nbdist', or 'other' for a listen() made by other code),
    ``connected`` (a debugger is attached) and ``note`` (a sentence or '').
    Runs on the rank's main thread (as a cell or an apply does), whose code
    the debugger then sees.
    """
    global _endpoint
    port = 0 if port is None else int(port)
    if not 0 <= port < 65536:
        raise ValueError(f"port {port} is not a TCP port (0..65535; 0: a free one)")
    try:
        import debugpy
    except ImportError as exc:
        raise ImportError(
            f"debugpy is not installed on rank {_rank()}: pip install debugpy"
        ) from exc

    with _lock:
        if _endpoint is not None:
            rearm()
            return _described(_endpoint, new=False)
        _skip_unlogged_environment_report()
        _check_bindable(host, port)
        try:
            # Must precede listen(): the rank's children (DataLoader workers, helper
            # processes) would otherwise each connect to the adapter as a debuggee.
            debugpy.configure(subProcess=False)
        except RuntimeError:
            pass  # debugging already started in this process: listen() says how below
        try:
            # In process: pydevd itself speaks the protocol on the socket. debugpy's
            # default starts an adapter process per listener (~0.5 CPU-s and ~14 MB unique
            # each: 64 ranks' debugger spent half its start there), whose one gain,
            # following subprocesses, is off above anyway.
            bound = debugpy.listen((host, port), in_process_debug_adapter=True)
        except RuntimeError as exc:
            if "already been called" not in str(exc):
                raise
            return _described(_other_listener(), new=False)
        if not bound:
            bound = _in_process_endpoint()
        _endpoint = {"host": bound[0], "port": int(bound[1]), "owner": "nbdist", "note": ""}
        tensor_view.show_tensors()  # tensors show shape, dtype, device (and small values)
        shell = _ipython_shell()
        if shell is not None:
            shell.events.register("pre_execute", rearm)
        return _described(_endpoint, new=True)


def rearm() -> bool:
    """Trace the calling thread again if an exception inside debugpy's tracer dropped it.

    True when it did. A no-op (False) unless :func:`listen` started debugpy
    here, and while another tracer (a profiler, coverage) is set.
    """
    if _endpoint is None or sys.gettrace() is not None:
        return False
    import debugpy

    info = getattr(threading.current_thread(), "additional_info", None)
    try:
        from _pydevd_bundle.pydevd_constants import STATE_SUSPEND
        from _pydevd_bundle.pydevd_thread_lifecycle import resume_threads
    except ImportError:  # another debugpy layout: tracing again is the part that matters
        pass
    else:
        # Interrupted while stopped: debugpy still counts the threads it stopped with
        # it as stopped (they would stop at their next line); continue them, as the
        # client's "continue" would have.
        if getattr(info, "pydev_state", None) == STATE_SUSPEND:
            resume_threads("*")
    debugpy.debug_this_thread()
    return True


def _ipython_shell():
    # The rank's IPython shell when it runs in one (an ipyparallel engine), without
    # importing IPython: under torchrun there is none, and listen() re-arms instead.
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _skip_unlogged_environment_report() -> None:
    # debugpy's first configure()/listen() describes the whole environment, reading every
    # installed distribution's metadata (0.2-0.6 CPU-s on a rank with ~180 packages), for
    # a log it writes only when a log directory is set (DEBUGPY_LOG_DIR, log_to()); without
    # one the text is dropped. 256 ranks sharing 2 cores spent most of their debugger
    # start on it. With a log directory debugpy logs as it always does.
    try:
        from debugpy.common import log
        from debugpy.server import api
    except ImportError:  # another debugpy layout: it describes, as it always did
        return
    ensure = getattr(api, "ensure_logging", None)
    if getattr(log, "log_dir", "") is None and getattr(ensure, "ensured", True) is False:
        ensure.ensured = True


def _check_bindable(host: str, port: int) -> None:
    # In process, debugpy binds on a thread of its own and waits for that socket without
    # end: a port in use or an address not of this host would hang the rank. Bound here
    # first, the way it binds, the failure is the error debugpy's adapter gave. Not when
    # other code's listen() came first: debugpy refuses a second one, and says so.
    from debugpy.server import api

    if getattr(api.listen, "called", False):
        return
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as exc:
        raise RuntimeError(f"Can't listen for client connections: {exc}") from None
    finally:
        probe.close()


def _in_process_endpoint() -> tuple[str, int]:
    # debugpy before 1.8.22 returns nothing from an in-process listen(); its pydevd
    # knows where it bound (port 0: the port the OS chose) once its socket is up.
    import pydevd

    debugger = pydevd.get_global_debugger()
    debugger.wait_for_server_socket_ready()
    host, port = debugger._server_socket_name[:2]  # noqa: SLF001 - no public form in those versions
    return host, port


def _other_listener() -> dict:
    # debugpy keeps no public record of where an earlier listen() listens. Its
    # adapter process was started with --host/--port on the command line; with
    # an explicit port (ipykernel's debugger passes one) that is the endpoint.
    from debugpy.server import api

    proc = getattr(api, "_adapter_process", None)
    args = list(getattr(proc, "args", None) or [])
    found = {flag: args[args.index(flag) + 1] for flag in ("--host", "--port") if flag in args[:-1]}
    port = int(found.get("--port", "0"))
    if port:
        note = (
            "debugpy was already listening in this process (started by other code, "
            "e.g. ipykernel's own debugger); that listener is the one to attach to"
        )
        return {"host": found.get("--host", LOOPBACK), "port": port, "owner": "other", "note": note}
    note = (
        "debugpy was already listening in this process, started by other code, at an "
        "endpoint it does not tell (debugpy listens once per process): attach where that "
        "code said, or %dist_restart for fresh ranks"
    )
    return {"host": None, "port": None, "owner": "other", "note": note}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _described(endpoint: dict, *, new: bool) -> dict:
    import debugpy

    return {
        **endpoint,
        "new": new,
        "rank": _rank(),
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
        "cwd": os.getcwd(),
        "connected": bool(debugpy.is_client_connected()),
    }


def attach_text(endpoint: dict, here: str | None = None) -> str:
    """How to attach to ``endpoint`` (from :func:`listen`) from the machine named ``here``.

    ``here``: the host name of the machine the debugger runs on (default: this
    one). Gives the address, a VS Code ``launch.json`` configuration and, for a
    rank on another host, the SSH tunnel and ``pathMappings`` it needs.
    """
    rank, port = endpoint["rank"], endpoint["port"]
    if port is None:
        return f"rank {rank}: {endpoint['note']}"
    here = socket.gethostname() if here is None else here
    remote = endpoint["hostname"] != here
    host = endpoint["host"]
    if host in ("0.0.0.0", "::"):
        host = endpoint["hostname"] if remote else LOOPBACK
    lines = []
    if endpoint["new"]:
        lines.append(f"rank {rank}: debugpy listening on {host}:{port} (pid {endpoint['pid']})")
    else:
        lines.append(f"rank {rank}: debugpy is already listening on {host}:{port}")
    if endpoint["note"]:
        lines.append(endpoint["note"])
    if endpoint["connected"]:
        lines.append("a debugger is attached to it now")
    config = {
        "name": f"nbdist rank {rank}",
        "type": "debugpy",
        "request": "attach",
        "connect": {"host": host, "port": port},
        "justMyCode": False,
    }
    if remote:
        if is_loopback(endpoint["host"]):
            # Loopback on the rank's host: reach it through a tunnel, as localhost here.
            config["connect"]["host"] = LOOPBACK
            lines.append(
                f"the rank runs on {endpoint['hostname']}: first open a tunnel from this "
                f"machine, ssh -N -L {port}:127.0.0.1:{port} {endpoint['hostname']}"
            )
        config["pathMappings"] = [
            {"localRoot": "${workspaceFolder}", "remoteRoot": endpoint["cwd"]}
        ]
    lines += [
        "VS Code (Python Debugger extension): add this to .vscode/launch.json's",
        '"configurations", then Run and Debug > "' + config["name"] + '":',
        json.dumps(config, indent=2),
        "Breakpoints go in .py files the rank imports: code typed in a cell has no",
        "file to set them in (breakpoint() in a cell opens pdb in the notebook instead).",
        "Any Debug Adapter Protocol client that attaches to a debugpy server by host",
        "and port works the same way.",
        "JupyterLab's debugger does not attach to this port: it reaches the ranks",
        "through the kernel (the bug icon; docs/debugging.md).",
    ]
    return "\n".join(lines)
