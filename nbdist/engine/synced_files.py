"""Rank side: the files ``%dist_sync`` sends, kept on this rank's machine and put on ``sys.path``.

The kernel (:mod:`nbdist.driver.file_sync`) sends a *manifest* of each path it
syncs: ``{relative path: [size, mtime_ns, sha256]}``. One rank per machine
(:func:`machine_key` says which ranks share one) answers :func:`look`: whether
this machine sees the path itself with the same files (the kernel's machine, a
shared file system: then nothing is copied), and otherwise which files its copy
lacks. Those arrive in chunks (:func:`write`); :func:`finish_copy` removes files the
path no longer has, and every rank then :func:`activate`\\ s the paths: each is
put first on ``sys.path`` and remembered, so ``%dist_run`` of a script under a
synced path runs this machine's copy (:func:`local_path`).

A copy lives in ``$NBDIST_SYNC_DIR`` (default: the temporary directory), under
``nbdist-sync-<uid>/<session>-<machine>/<hash of the path>-<name>``;
:func:`remove_copies` deletes a session's
copies at ``%dist_stop``, and :func:`prune` those of sessions whose ranks are all
gone (a rank killed with ``kill -9`` never removes them itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import socket
import sys
import tempfile

import psutil  # an ipyparallel dependency: every engine has it

__all__ = [
    "SYNC_DIR_ENV",
    "activate",
    "copies_dir",
    "copies_here",
    "finish_copy",
    "local_path",
    "look",
    "machine_key",
    "prune",
    "reload_stale",
    "remove_copies",
    "write",
]

SYNC_DIR_ENV = "NBDIST_SYNC_DIR"
_OWNERS = ".owners"  # in a session's folder: one empty file per rank that uses its copies
# {path on the kernel's machine: path here}, for every path synced in this process.
_ACTIVE: dict[str, str] = {}
# Modules imported from files a sync has changed since: named at each sync until reloaded
# (or imported afresh by hand: the module object is no longer the one noted). name -> id.
_STALE: dict[str, int] = {}


def machine_key() -> str:
    """Ranks that share this key see one file system: the host, its boot and its mount namespace.

    The mount namespace tells two containers on one host apart (they share the boot id).
    """
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/mnt").st_ino))
    except OSError:  # not Linux: the host name alone
        pass
    return "/".join(parts)


def _machine_tag() -> str:
    return hashlib.sha256(machine_key().encode()).hexdigest()[:8]


def copies_dir(session: str) -> str:
    """Where this machine keeps the copies of session ``session``.

    Named by the machine too: a ``$NBDIST_SYNC_DIR`` that several machines share
    holds one folder per machine, and :func:`prune` on one never judges another's.
    """
    root = os.environ.get(SYNC_DIR_ENV) or tempfile.gettempdir()
    return os.path.join(root, f"nbdist-sync-{os.getuid()}", f"{session}-{_machine_tag()}")


def _copy_dir(session: str, origin: str) -> str:
    # Named by the origin's whole path too: two synced paths of one name (a/src, b/src)
    # keep apart, and a path gets the same folder whichever kernel syncs it, in any order.
    name = os.path.basename(origin.rstrip(os.sep)) or "root"
    return os.path.join(
        copies_dir(session), f"{hashlib.sha256(origin.encode()).hexdigest()[:8]}-{name}"
    )


def _same_file(path: str, size: int, mtime_ns: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_size == size and st.st_mtime_ns == mtime_ns


def _same_size(path: str, size: int) -> bool:
    try:
        return os.stat(path).st_size == size
    except OSError:
        return False


def _stored(copy: str) -> dict:
    try:
        with open(os.path.join(copy, ".nbdist-manifest.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def look(session: str, origin: str, manifest: dict, copy: bool) -> dict:
    """Whether this machine needs a copy of ``origin``, and of which files.

    ``{"in_place": True}`` when ``copy`` is False and every file of ``manifest`` is
    at ``origin`` here with the same size and modification time (the kernel's machine,
    a shared file system); else ``{"in_place": False, "missing": [relative paths],
    "gone": n}``: the files this machine's copy lacks or holds in another version,
    and how many it holds that the last sync sent and ``manifest`` no longer has.
    """
    if not copy and all(
        _same_file(os.path.join(origin, rel), size, mtime)
        for rel, (size, mtime, _sha) in manifest.items()
    ):
        return {"in_place": True}
    with _copies_writable(session):
        prune()
    target = _copy_dir(session, origin)
    have = _stored(target)
    # By content: a file touched but not changed is not sent again; one the copy lost
    # meanwhile (a /tmp cleaner in a long session, a rank's own rm) is.
    missing = [
        rel
        for rel, entry in manifest.items()
        if rel not in have
        or have[rel][2] != entry[2]
        or not _same_size(os.path.join(target, rel), entry[0])
    ]
    return {"in_place": False, "missing": missing, "gone": len(set(have) - set(manifest))}


def write(session: str, origin: str, files: dict, manifest: dict | None = None) -> tuple[int, int]:
    """Write ``{relative path: (bytes, sha256, executable)}`` into this machine's copy.

    Each file is checked against its digest and replaced whole (written beside it,
    then renamed), so a rank importing meanwhile sees the old or the new file, never
    half of one. A folder where a file now goes (or a file where a folder now goes)
    is removed first. The last call of a sync brings its ``manifest``: then
    :func:`finish_copy` (in the same round trip). Returns (bytes written, files removed).
    """
    target = _copy_dir(session, origin)
    with _copies_writable(session):
        _own(session)
    written = 0
    for rel, (data, sha, executable) in files.items():
        if hashlib.sha256(data).hexdigest() != sha:
            raise OSError(f"{rel}: the copy received differs from the file sent (digest)")
        path = os.path.join(target, rel)
        _clear_way(target, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.nbdist-part-{os.getpid()}"
        try:
            with open(part, "wb") as f:
                f.write(data)
            os.chmod(part, 0o755 if executable else 0o644)
            os.replace(part, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(part)
            raise
        written += len(data)
    removed = finish_copy(session, origin, manifest) if manifest is not None else 0
    return written, removed


@contextlib.contextmanager
def _copies_writable(session: str):
    # This machine's copies folder cannot be made or written: said with the setting that moves it.
    try:
        yield
    except OSError as exc:
        raise OSError(
            f"cannot keep %dist_sync's copies in {copies_dir(session)} on "
            f"{socket.gethostname()} ({exc.strerror or exc}): set {SYNC_DIR_ENV} on the ranks "
            "to a folder they can write"
        ) from None


def _clear_way(target: str, rel: str) -> None:
    # The last sync's tree may differ in kind: a file where a folder of ``rel`` now is,
    # or a folder where the file ``rel`` now goes.
    parts = rel.split(os.sep)
    for depth in range(1, len(parts)):
        above = os.path.join(target, *parts[:depth])
        if os.path.lexists(above) and not os.path.isdir(above):
            os.remove(above)
            break
    path = os.path.join(target, rel)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)


def finish_copy(session: str, origin: str, manifest: dict) -> int:
    """Remove from this machine's copy the files the last sync sent that ``manifest`` lacks.

    Only those: what the ranks wrote there themselves (``__pycache__``, a script's
    output beside it) stays. Records ``manifest``; returns the files removed.
    """
    target = _copy_dir(session, origin)
    os.makedirs(target, exist_ok=True)
    removed = 0
    for rel in set(_stored(target)) - set(manifest):
        path = os.path.join(target, rel)
        # A folder there now holds files this sync sent (see _clear_way): it stays.
        if os.path.isfile(path) or os.path.islink(path):
            os.remove(path)
            removed += 1
        # Folders the removal emptied go too (only empty ones: rmdir refuses the rest).
        folder = os.path.dirname(path)
        while folder != target and folder.startswith(target + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)
    record = os.path.join(target, ".nbdist-manifest.json")
    with open(f"{record}.part", "w") as f:
        json.dump(manifest, f)
    os.replace(f"{record}.part", record)
    return removed


def activate(session: str, paths: list, changed: dict, reload: bool) -> tuple[dict, list]:
    """Put each synced path (or this machine's copy of it) first on ``sys.path``.

    ``paths``: ``[(origin, {machine key: in place})]``, the first to come first
    on ``sys.path`` (as in ``PYTHONPATH``); files are reached under
    the origin's own path where this machine sees it in place, else under the copy's.
    ``changed``: ``{origin: [relative paths]}`` whose content changed since the last
    sync: modules imported from them are stale until reloaded (:func:`reload_stale`,
    which ``reload`` calls). Returns ``({origin: the path used here}, [(stale or
    reloaded module, what reloading it raised or "")])``.
    """
    key = machine_key()
    used = {}
    for origin, in_place_by_machine in reversed(paths):  # each inserted first
        in_place = in_place_by_machine[key]
        here = origin if in_place else _copy_dir(session, origin)
        if not in_place:
            _own(session)
        before = _ACTIVE.get(origin)
        if before is not None and before != here and before in sys.path:
            sys.path.remove(before)
        if here in sys.path:
            sys.path.remove(here)
        sys.path.insert(0, here)
        _ACTIVE[origin] = used[origin] = here
    importlib.invalidate_caches()  # files written since the last import are found
    # A module counts as imported from a file by the origin's path or the copy's.
    files = {
        os.path.realpath(os.path.join(root, rel))
        for origin, rels in changed.items()
        for root in {origin, used.get(origin, origin)}
        for rel in rels
    }
    if files:
        # Only modules under a synced path are resolved (os.path.realpath of each of
        # torch's thousand modules would cost tens of milliseconds at every sync).
        roots = tuple({p for origin in changed for p in (origin, used.get(origin, origin))})
        roots += tuple(os.path.realpath(r) for r in roots)
        for name, module in list(sys.modules.items()):
            file = getattr(module, "__file__", None)
            if file and file.startswith(roots) and os.path.realpath(file) in files:
                _STALE[name] = id(module)
    for name, noted in list(_STALE.items()):
        if id(sys.modules.get(name)) != noted:
            del _STALE[name]
    return used, reload_stale() if reload else [(name, "") for name in sorted(_STALE)]


def reload_stale() -> list:
    """Reload the modules imported from files a sync changed since; ``[(module, error or "")]``."""
    out = []
    # Submodules before their packages, and the packages above a changed module too: a
    # package's `from .sub import f` then finds the new f. (Names other modules imported
    # from a reloaded one keep the old objects, as with importlib.reload.)
    names = set(_STALE)
    for name in _STALE:
        parts = name.split(".")
        names.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if _synced(p))
    for name in sorted(names, key=lambda n: (-n.count("."), n)):
        module = sys.modules.get(name)
        if module is None:
            continue
        error = ""
        try:
            importlib.reload(module)
        except Exception as exc:  # the user's module: say what it raised, go on
            error = f"{type(exc).__name__}: {exc}"
        out.append((name, error))
    _STALE.clear()
    return out


def _synced(name: str) -> bool:
    # Whether module ``name`` was imported from a synced path (never torch, never nbdist).
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return False
    file = os.path.realpath(file)
    roots = {os.path.realpath(p) for pair in _ACTIVE.items() for p in pair}
    return any(file.startswith(root + os.sep) for root in roots)


def copies_here() -> dict[str, str]:
    """``{synced path on the kernel's machine: its copy here}``, for the paths run from copies."""
    return {origin: here for origin, here in _ACTIVE.items() if here != origin}


def local_path(path: str) -> str:
    """``path`` (on the kernel's machine) as this machine reaches it: in a synced copy, if any."""
    for origin, here in _ACTIVE.items():
        if here == origin:
            continue
        prefix = origin.rstrip(os.sep) + os.sep
        if path == origin or path.startswith(prefix):
            there = os.path.join(here, os.path.relpath(path, origin))
            if os.path.exists(there):
                return there
    return path


def _own(session: str) -> None:
    # This process uses the session's copies: noted (one file per rank, no shared file to
    # race on), so prune keeps them while it lives.
    folder = os.path.join(copies_dir(session), _OWNERS)
    os.makedirs(folder, exist_ok=True)
    me = psutil.Process()
    open(os.path.join(folder, f"{me.pid}-{me.create_time():.3f}"), "w").close()


def _alive(owner: str) -> bool:
    pid, _, created = owner.partition("-")
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(created)) < 0.01
    except (psutil.Error, ValueError):
        return False


def remove_copies(session: str) -> None:
    """Delete this machine's copies of session ``session`` (``%dist_stop``)."""
    shutil.rmtree(copies_dir(session), ignore_errors=True)


def prune() -> list[str]:
    """Delete the copies of sessions whose ranks are all gone; the sessions removed."""
    root = os.path.dirname(copies_dir("any"))
    try:
        sessions = os.listdir(root)
    except OSError:
        return []
    gone = []
    mine = f"-{_machine_tag()}"
    for name in sessions:
        if not name.endswith(mine):  # another machine's (a shared $NBDIST_SYNC_DIR)
            continue
        try:
            owners = os.listdir(os.path.join(root, name, _OWNERS))
        except OSError:  # being made, or not nbdist's
            continue
        if not any(_alive(owner) for owner in owners):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            gone.append(name)
    return gone
