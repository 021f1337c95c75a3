"""The registry of running clusters: one small JSON file per cluster, for the JupyterLab sidebar.

A kernel that starts a cluster (``%dist_start``, :meth:`DistSession.start`)
writes ``<jupyter runtime dir>/nbdist-clusters/cluster-<kernel pid>-<n>.json``
once the process group is formed, and removes it when the cluster stops. The
directory is private (``0700``) and each file ``0600``: it names PIDs and the
cluster's connection file. The Jupyter server extension (:mod:`nbdist.server`)
only reads it. An entry whose kernel process is gone (the kernel was killed
before it could clean up) is stale: :func:`clusters` skips it.

Example::

    from nbdist import DistSession, registry

    with DistSession(2) as s:
        [entry] = [c for c in registry.clusters() if c["kernel_pid"] == os.getpid()]
        entry["ranks"][0]["pid"]      # rank 0's engine PID
        entry["backend"]              # 'gloo'
    registry.clusters()               # [] again: stop() removed the entry

Only the standard library and psutil are imported here, so the server can
read the registry without importing torch or ipyparallel.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import time

import psutil

__all__ = ["FORMAT", "act", "clusters", "kernel_id", "register", "registry_dir", "unregister"]

FORMAT = 1  # bumped if an entry's fields change meaning
_counter = itertools.count()
_NAME = re.compile(r"^cluster-\d+-\d+\.json$")


def registry_dir(create: bool = False) -> str:
    """``<jupyter runtime dir>/nbdist-clusters`` (``$JUPYTER_RUNTIME_DIR`` is honoured).

    ``create`` makes it (``0700``; an existing one is narrowed to ``0700`` too).
    """
    from jupyter_core.paths import jupyter_runtime_dir

    path = os.path.join(jupyter_runtime_dir(), "nbdist-clusters")
    if create:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
    return path


def kernel_id() -> str | None:
    """This kernel's id (from its connection file ``kernel-<id>.json``), None outside a kernel."""
    try:
        from ipykernel.connect import get_connection_file

        name = os.path.basename(get_connection_file())
    except Exception:  # not an ipykernel (a script, terminal IPython)
        return None
    match = re.match(r"^kernel-(.+)\.json$", name)
    return match.group(1) if match else None


def _connection_file() -> str | None:
    try:
        from ipykernel.connect import get_connection_file

        return get_connection_file()
    except Exception:
        return None


def _client_file(session) -> str | None:
    """The ipyparallel client connection file of the session's cluster (0600), if known."""
    attach = session.options.get("attach")
    if attach:
        return os.path.abspath(attach)
    cluster = session._handle.cluster
    controller = getattr(cluster, "controller", None)
    path = getattr(controller, "connection_files", {}).get("client")
    if path and os.path.exists(path):
        return path
    security = os.path.join(session._handle.profile_dir or "", "security")
    found = sorted(glob.glob(os.path.join(security, "ipcontroller*client.json")))
    return found[0] if found else None


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def register(session) -> str | None:
    """Write the registry entry of a started :class:`~nbdist.DistSession`; returns its path.

    Never raises: the sidebar is a convenience, a cluster that started must
    not fail because its entry could not be written (a warning says why).
    """
    try:
        return _write(session)
    except Exception as exc:
        import warnings

        warnings.warn(
            f"nbdist: the JupyterLab sidebar will not list this cluster ({exc})", stacklevel=2
        )
        return None


def _write(session) -> str:
    handle = session._handle
    cluster = handle.cluster
    controller = getattr(cluster, "controller", None) if cluster is not None else None
    metrics = session._metrics
    pid = os.getpid()
    entry = {
        "format": FORMAT,
        "kernel_id": kernel_id(),
        "kernel_pid": pid,
        "kernel_started": _create_time(pid),
        "kernel_connection_file": _connection_file(),
        "owned": bool(handle.owned),
        "profile_dir": handle.profile_dir,
        "cluster_file": getattr(cluster, "cluster_file", None) if cluster is not None else None,
        "connection_file": _client_file(session),
        "controller_pid": getattr(controller, "pid", None),
        "pids": sorted(handle.pids),
        "backend": session.backend,
        "world_size": session.world_size,
        "ranks": [
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "engine": r.engine_id,
                "pid": r.pid,
                "host": r.host,
                "device": r.device,
            }
            for r in session.ranks
        ],
        "run_id": metrics.run.id if metrics is not None and metrics.store is not None else None,
        "history": metrics.store.path
        if metrics is not None and metrics.store is not None
        else None,
        "started": time.time(),
    }
    old = getattr(session, "_registry_path", None)
    folder = registry_dir(create=True)
    path = old or os.path.join(folder, f"cluster-{pid}-{next(_counter)}.json")
    tmp = path + ".tmp"
    # Written then renamed: a reader never sees half an entry.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)
    session._registry_path = path
    return path


def unregister(session) -> None:
    """Remove the session's entry, if it has one (idempotent, never raises)."""
    path = getattr(session, "_registry_path", None)
    session._registry_path = None
    if path:
        try:
            os.remove(path)
        except OSError:
            pass


def _alive(pid: int | None, created: float | None) -> bool:
    if not pid:
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        # The same PID with another start time is another process (PID reuse).
        return created is None or abs(proc.create_time() - created) < 1.0
    except psutil.Error:
        return False


def clusters(folder: str | None = None) -> list[dict]:
    """Entries of clusters whose kernel is still alive, oldest first.

    Each entry gets an ``id`` (its file name without ``.json``). Entries of a
    dead kernel are skipped (and removed when this user may remove them).
    """
    folder = folder or registry_dir()
    try:
        names = sorted(n for n in os.listdir(folder) if _NAME.match(n))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                entry = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            continue
        if not _alive(entry.get("kernel_pid"), entry.get("kernel_started")):
            try:  # its kernel cannot remove it any more
                os.remove(path)
            except OSError:
                pass
            continue
        entry["id"] = name[: -len(".json")]
        out.append(entry)
    out.sort(key=lambda e: (e.get("started") or 0, e["id"]))
    return out


def act(cluster_id: str, action: str) -> None:
    """In the kernel: ``restart`` or ``stop`` the session whose entry is ``cluster_id``.

    What the sidebar's Restart/Stop buttons run in the cluster's kernel (the
    Jupyter server sends it as a silent execute request), so the session
    itself stops its processes by PID and closes its run, as ``%dist_stop`` does.
    """
    from .session import _live

    if action not in ("restart", "stop"):
        raise ValueError(f"action {action!r}: use 'restart' or 'stop'")
    for session in list(_live):
        path = getattr(session, "_registry_path", None)
        if path and os.path.basename(path) == f"{cluster_id}.json":
            if action == "restart":
                session.restart()
            else:
                session.stop()
            return
    raise LookupError(f"no running cluster {cluster_id!r} in this kernel (already stopped?)")
