"""Kernel side (read by the Jupyter server too): running clusters, one JSON file each, for the sidebar.

A kernel that starts a cluster (``%dist_start``, :meth:`DistSession.start`)
writes ``<jupyter runtime dir>/nbdist-clusters/cluster-<kernel pid>-<n>.json``
once the process group is formed, and removes it when the cluster stops. The
directory is private (``0700``) and each file ``0600``: it names PIDs and the
cluster's connection file. The Jupyter server extension (:mod:`nbdist.server`)
only reads it. An entry whose kernel process is gone (the kernel was killed
before it could clean up) is stale: :func:`clusters` skips it.

Example::

    from nbdist import DistSession
    from nbdist.driver import registry

    with DistSession(2) as s:
        [entry] = [c for c in registry.clusters() if c["kernel_pid"] == os.getpid()]
        entry["ranks"][0]["pid"]      # rank 0's engine PID
        entry["backend"]              # 'gloo'
    registry.clusters()               # [] again: stop() removed the entry

Only the standard library and psutil (through :mod:`nbdist.launch.process_tree`)
are imported here, so the server can read the registry without importing torch
or ipyparallel.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import time
import weakref

from nbdist.launch import process_tree

__all__ = [
    "FORMAT",
    "act",
    "clusters",
    "kernel_id",
    "register_cluster",
    "registry_dir",
    "unregister_cluster",
]

FORMAT = 1  # bumped if an entry's fields change meaning
_counter = itertools.count()
_NAME = re.compile(r"^cluster-\d+-\d+\.json$")
# Entry path -> the object that registered it (a DistSession): what act() restarts or stops.
_owners: dict[str, weakref.ReferenceType] = {}


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


def _client_file(handle, connection_file: str | None) -> str | None:
    """The ipyparallel client connection file of the cluster (0600), if known."""
    return os.path.abspath(connection_file) if connection_file else handle.client_file()


def register_cluster(
    owner,
    *,
    handle,
    ranks,
    backend: str | None,
    run_id: int | None = None,
    history: str | None = None,
    connection_file: str | None = None,
    path: str | None = None,
) -> str | None:
    """Write a started cluster's entry; returns its path (pass it back as ``path`` to rewrite it).

    ``owner``: what :func:`act` restarts or stops (the :class:`~nbdist.DistSession`),
    held weakly. ``handle``: its :class:`~nbdist.launch.cluster.ClusterHandle`;
    ``ranks``: its :class:`~nbdist.driver.group.RankInfo` list; ``connection_file``: the
    cluster file a session connected through (None: the one its cluster wrote). Never raises: the
    sidebar is a convenience, a cluster that started must not fail because its
    entry could not be written (a warning says why).
    """
    try:
        entry = _entry(handle, ranks, backend, run_id, history, connection_file)
        # Entries of kernels that are gone (killed: none removed its own) go as a new one
        # comes, not only when the server lists them: kernels run without one too.
        clusters()
        path = _write(entry, path)
    except Exception as exc:
        import warnings

        warnings.warn(
            f"nbdist: the JupyterLab sidebar will not list this cluster ({exc})", stacklevel=2
        )
        return None
    _owners[path] = weakref.ref(owner)
    return path


def _entry(handle, ranks, backend, run_id, history, connection_file) -> dict:
    cluster = handle.cluster
    controller = getattr(cluster, "controller", None) if cluster is not None else None
    pid = os.getpid()
    return {
        "format": FORMAT,
        "kernel_id": kernel_id(),
        "kernel_pid": pid,
        "kernel_started": (process_tree.pid_entry(pid) or {}).get("created"),
        "kernel_connection_file": _connection_file(),
        "owned": bool(handle.owned),
        "profile_dir": handle.profile_dir,
        "cluster_file": getattr(cluster, "cluster_file", None) if cluster is not None else None,
        "connection_file": _client_file(handle, connection_file),
        "controller_pid": getattr(controller, "pid", None),
        "pids": sorted(handle.pids),
        "backend": backend,
        "world_size": len(ranks),
        "ranks": [
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "engine": r.engine_id,
                "pid": r.pid,
                "host": r.host,
                "device": r.device,
                "pid_here": r.pid_here,  # False: the PID is another machine's (or namespace's)
            }
            for r in ranks
        ],
        "run_id": run_id,
        "history": history,
        "started": time.time(),
    }


def _write(entry: dict, path: str | None) -> str:
    folder = registry_dir(create=True)
    path = path or os.path.join(folder, f"cluster-{entry['kernel_pid']}-{next(_counter)}.json")
    tmp = path + ".tmp"
    # Written then renamed: a reader never sees half an entry.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, path)
    return path


def unregister_cluster(path: str | None) -> None:
    """Remove the entry at ``path`` (None: nothing to do); idempotent, never raises."""
    if not path:
        return
    _owners.pop(path, None)
    try:
        os.remove(path)
    except OSError:
        pass


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
        kernel = {"pid": entry.get("kernel_pid"), "created": entry.get("kernel_started")}
        if process_tree.alive(kernel) is None:
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
    if action not in ("restart", "stop"):
        raise ValueError(f"action {action!r}: use 'restart' or 'stop'")
    for path, ref in list(_owners.items()):
        owner = ref()
        if owner is not None and os.path.basename(path) == f"{cluster_id}.json":
            if action == "restart":
                owner.restart()
            else:
                owner.stop()
            return
    raise LookupError(f"no running cluster {cluster_id!r} in this kernel (already stopped?)")
