"""Kernel side: ``%dist_sync``: this machine's files importable on every rank, wherever it runs.

Ranks on other machines see none of the notebook's files unless a shared file
system holds them. :func:`sync_files` makes a directory (or files) the
notebook's machine has importable on every rank: a machine that sees the path
itself with the same files (this one, a shared file system) uses it in place;
any other gets a copy, and later syncs send only the files whose content changed
(and remove those deleted). One rank per machine writes
(:func:`nbdist.engine.synced_files.machine_key`), so 256 ranks on 32 machines
receive each file 32 times, not 256. Each path is put first on the ranks'
``sys.path``; ``%dist_run`` of a script under a synced path runs the copy.

A restart syncs the paths again (its ranks are fresh processes); a stop removes
the copies. Example::

    report = sync_files(session, ["src", "train.py"])
    print(report)   # nbdist: synced src/ (12 files, 48.0 KiB) ... to 2 machines ...
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import fnmatch
import hashlib
import heapq
import os
import stat
import uuid
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from nbdist.driver.comm_table import format_size
from nbdist.engine import synced_files
from nbdist.errors import ClusterNotRunning, NbdistError

__all__ = [
    "DEFAULT_EXCLUDES",
    "MAX_BYTES",
    "SyncReport",
    "resync",
    "session_stopping",
    "sync_files",
]

# Never sent: version control, caches, environments and notebook checkpoints.
DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    "__pycache__",
    "*.pyc",
    ".ipynb_checkpoints",
    ".venv",
    "venv",
    "node_modules",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
)
# A sync is for code and small files: more than this goes through the controller slowly.
MAX_BYTES = 1 << 30
# Far more than a project's code; %dist_sync of a home folder (or of /, whose /proc holds
# files by the million) is refused at this count, not after walking all of it.
MAX_FILES = 100_000
_CHUNK_BYTES = 16 << 20  # per message to a rank


@dataclass
class _Entry:
    # One synced directory (or the chosen files of one).
    origin: str  # the directory's absolute path on this machine
    files: set[str] | None  # None: the whole directory; else these names in it
    excludes: tuple[str, ...]
    in_place: dict[str, bool] = field(default_factory=dict)  # by machine key
    last: dict[str, list] | None = None  # the manifest the last sync sent


@dataclass
class _State:
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    entries: dict[str, _Entry] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # origins, first on sys.path first
    copy: bool = False
    digests: dict[str, tuple] = field(default_factory=dict)  # path -> (size, mtime_ns, sha256)
    machines: tuple | None = None  # ((engine id, pid) of each rank, their machine keys)


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class SyncReport:
    """What one sync did; ``str()`` is the line ``%dist_sync`` prints."""

    paths: list[str]
    files: int
    bytes: int
    machines: int
    in_place: int  # machines that use the paths where they are
    sent_files: int  # new or changed files sent (each once however many machines lacked it)
    sent_bytes: int
    removed: int
    used: dict[int, dict[str, str]]  # rank -> {path here: path on the rank}
    modules: dict[str, list[int]]  # stale (or, with reload, reloaded) module -> ranks
    reloaded: bool
    reload_errors: dict[str, str]  # module -> what reloading it raised (first rank's words)

    def __str__(self) -> str:
        """The report in words, one line (more when changed modules were imported)."""
        copied = self.machines - self.in_place
        parts = []
        if self.in_place:
            parts.append(f"{self.in_place} see{'s' * (self.in_place == 1)} them in place")
        if copied:
            sent = (
                f"{self.sent_files} file{'s' * (self.sent_files != 1)} sent, "
                f"{format_size(self.sent_bytes)}"
                if self.sent_files
                else "up to date"
            )
            gone = f", {self.removed} removed" if self.removed else ""
            parts.append(f"{copied} hold{'s' * (copied == 1)} a copy ({sent}{gone})")
        line = (
            f"nbdist: synced {', '.join(self.paths)} ({self.files} file{'s' * (self.files != 1)}, "
            f"{format_size(self.bytes)}) to {self.machines} machine{'s' * (self.machines != 1)}: "
            + "; ".join(parts)
        )
        names = ", ".join(sorted(self.modules))
        if self.modules and self.reloaded:
            line += f"\nnbdist: reloaded on the ranks: {names}"
            for name, error in sorted(self.reload_errors.items()):
                line += f"\nnbdist: reloading {name} failed: {error}"
        elif self.modules:
            line += (
                f"\nnbdist: the ranks imported {names} before its file changed: "
                "%dist_sync --reload reloads it (or %dist_restart)"
            )
        return line


def _excluded(rel: str, patterns: Sequence[str]) -> bool:
    parts = rel.split(os.sep)
    return any(fnmatch.fnmatch(part, pat) for part in parts for pat in patterns) or any(
        fnmatch.fnmatch(rel, pat) for pat in patterns
    )


def _digest(state: _State, path: str, st: os.stat_result) -> str:
    # Read again only when its size or modification time changed (one entry per path).
    known = state.digests.get(path)
    if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
        return known[2]
    sha = _sha256_of(path)
    state.digests[path] = (st.st_size, st.st_mtime_ns, sha)
    return sha


def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _Tally:
    """What the walks of one sync found so far, over all its paths: refused past a limit."""

    def __init__(self, max_bytes: int, max_files: int = MAX_FILES) -> None:
        self.max_bytes, self.max_files = max_bytes, max_files
        self.bytes = self.files = 0
        self.largest: list[tuple[int, str]] = []  # the 3 largest files, a min-heap

    def add(self, path: str, size: int) -> None:
        self.bytes += size
        self.files += 1
        heapq.heappush(self.largest, (size, path))
        if len(self.largest) > 3:
            heapq.heappop(self.largest)
        if self.bytes > self.max_bytes:
            named = ", ".join(
                f"{os.path.relpath(p)} ({format_size(s)})" for s, p in sorted(self.largest)[::-1]
            )
            raise NbdistError(
                f"%dist_sync: more than {format_size(self.max_bytes)} to send, the limit "
                f"({format_size(self.bytes)} in the first {self.files:,} files; largest: {named}): "
                "leave data out with --exclude 'data/*' (it travels through the controller), "
                "or put it on a file system every machine mounts"
            )
        if self.files > self.max_files:
            raise NbdistError(
                f"%dist_sync: more than {self.max_files:,} files to send (the last one found: "
                f"{path}): sync the folders that hold your code, e.g. %dist_sync src, or leave "
                "the rest out with --exclude (from Python: sync_files(..., max_files=N))"
            )


def _listing(entry: _Entry, tally: _Tally | None = None) -> dict[str, tuple[str, os.stat_result]]:
    # {relative path: (path, its stat)} of the files the entry covers; a linked folder is
    # followed as the importing rank would (once: a link back up is no loop here). ``tally``
    # refuses the sync as soon as the files found pass its limits.
    tally = tally or _Tally(MAX_BYTES)
    if not os.path.isdir(entry.origin):
        raise NbdistError(
            f"%dist_sync: {entry.origin} is gone (or no longer a directory): "
            "sync a path that exists, or %dist_restart without it after a new %dist_start"
        )
    listing: dict[str, tuple[str, os.stat_result]] = {}
    if entry.files is not None:
        for name in sorted(entry.files):
            _found(entry, listing, name, os.path.join(entry.origin, name), tally)
    else:
        # The real folders on the way down to each folder walked: a link to one of them
        # would be a loop. A second link to one folder elsewhere is followed, as an import
        # through it would be.
        above = {".": {os.path.realpath(entry.origin)}}
        for here, dirs, names in os.walk(entry.origin, followlinks=True):
            rel_dir = os.path.relpath(here, entry.origin)
            kept = []
            for d in sorted(dirs):
                rel = os.path.normpath(os.path.join(rel_dir, d))
                real = os.path.realpath(os.path.join(here, d))
                # Excluded folders are not entered at all (a .venv can hold 100,000 files).
                if real in above[rel_dir] or _excluded(rel, entry.excludes):
                    continue
                above[rel] = above[rel_dir] | {real}
                kept.append(d)
            dirs[:] = kept
            for name in sorted(names):
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if not _excluded(rel, entry.excludes):
                    _found(entry, listing, rel, os.path.join(here, name), tally)
    return listing


def _found(entry: _Entry, listing: dict, rel: str, path: str, tally: _Tally) -> None:
    try:
        st = os.stat(path)
    except OSError:  # a dangling link, a file deleted meanwhile
        if entry.files is not None:  # a file synced by name and deleted since: no longer
            entry.files.discard(rel)
        return
    if stat.S_ISREG(st.st_mode):
        listing[rel] = (path, st)
        tally.add(path, st.st_size)


def _manifest(state: _State, listing: dict) -> dict[str, list]:
    # {relative path: [size, mtime_ns, sha256]}: what the ranks compare and keep.
    manifest = {}
    for rel, (path, st) in listing.items():
        with _readable(path):
            manifest[rel] = [st.st_size, st.st_mtime_ns, _digest(state, path, st)]
    return manifest


@contextlib.contextmanager
def _readable(path: str):
    # A file this kernel cannot read (permissions, deleted meanwhile): said with its name.
    try:
        yield
    except OSError as exc:
        raise NbdistError(
            f"%dist_sync: cannot read {path} ({exc.strerror or exc}): "
            "leave it out with --exclude, or make it readable"
        ) from None


def _entries_for(state: _State, paths: Sequence[str], exclude: tuple[str, ...]) -> list[_Entry]:
    # Every path checked before any is remembered: a bad one changes nothing.
    found: list[tuple[str, str | None]] = []
    for given in paths:
        path = os.path.abspath(os.path.expanduser(os.fspath(given)))
        if os.path.isdir(path):
            found.append((path, None))
        elif os.path.isfile(path):
            found.append((os.path.dirname(path), os.path.basename(path)))
        else:
            raise NbdistError(
                f"%dist_sync: no file or directory {given!r} (looked for {path}): "
                "give a path on the notebook's machine, e.g. %dist_sync src"
            )
    chosen: list[_Entry] = []
    for origin, name in found:
        entry = state.entries.get(origin)
        if entry is None:
            entry = state.entries[origin] = _Entry(origin, set(), (*DEFAULT_EXCLUDES, *exclude))
        elif exclude:  # given again: these now; not given: the path's earlier ones still
            entry.excludes = (*DEFAULT_EXCLUDES, *exclude)
        if name is None:
            entry.files = None
        elif entry.files is not None:
            entry.files.add(name)
        if entry not in chosen:
            chosen.append(entry)
    return chosen


def _shown(entry: _Entry) -> str:
    home = os.path.expanduser("~")
    if entry.files:
        names = [os.path.join(entry.origin, n) for n in sorted(entry.files)]
    else:
        names = [entry.origin + os.sep]
    out = []
    for name in names:
        try:
            rel = os.path.relpath(name, os.getcwd())
        except ValueError:
            rel = name
        if rel.startswith(".."):
            rel = "~" + name[len(home) :] if name.startswith(home + os.sep) else name
        out.append(rel + (os.sep if name.endswith(os.sep) and not rel.endswith(os.sep) else ""))
    return ", ".join(out)


def sync_files(
    session,
    paths: Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    exclude: Sequence[str] | str = (),
    copy: bool = False,
    reload: bool = False,
    max_bytes: int = MAX_BYTES,
    max_files: int = MAX_FILES,
) -> SyncReport:
    """Make ``paths`` (directories or files here) importable on every rank of ``session``.

    ``exclude``: more glob patterns left out (matched against each name and each
    relative path), besides :data:`DEFAULT_EXCLUDES`. ``copy``: a copy on every
    machine even where the path is seen in place (a network file system slow under
    many ranks). ``reload``: reload the modules the ranks imported from files that
    changed. More than ``max_bytes`` in all, or more than ``max_files`` files, is refused
    before anything is sent.
    """
    if not session.running:
        raise ClusterNotRunning("%dist_sync: no ranks to sync to: %dist_start first")
    # One path or pattern given as such, not as a list: not read letter by letter.
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    if isinstance(exclude, (str, bytes)):
        exclude = [exclude]
    if not paths:
        raise NbdistError("%dist_sync: give a directory or file to sync, e.g. %dist_sync src")
    state = _STATES.get(session)
    if state is None:
        # A named session's copies outlive this kernel: another that attaches finds them.
        name = getattr(session, "name", None)
        state = _STATES[session] = _State(token=f"named-{name}") if name else _State()
    # 'data/' means the folder, as in .gitignore.
    exclude = tuple(p.rstrip("/") or p for p in exclude)
    # A refused sync (a bad path, too much) leaves the paths synced before as they were.
    before = copy_module.deepcopy((state.entries, state.order)), state.copy
    state.copy = state.copy or copy
    try:
        entries = _entries_for(state, paths, exclude)
        # The paths of this call first, in the order given (as in PYTHONPATH).
        state.order = [e.origin for e in entries] + [
            o for o in state.order if o not in {e.origin for e in entries}
        ]
        return _sync(
            session, state, entries, reload=reload, max_bytes=max_bytes, max_files=max_files
        )
    except BaseException:
        (state.entries, state.order), state.copy = before
        raise


def _sync(
    session,
    state: _State,
    entries: list[_Entry],
    *,
    reload: bool,
    max_bytes: int,
    max_files: int = MAX_FILES,
) -> SyncReport:
    # Refused by the files' sizes and number while they are found, before any is read
    # (%dist_sync . in a home folder).
    tally = _Tally(max_bytes, max_files)
    listings = {e.origin: _listing(e, tally) for e in entries}
    total = tally.bytes
    for entry in entries:
        if not listings[entry.origin]:
            extra = entry.excludes[len(DEFAULT_EXCLUDES) :]
            by = f"--exclude {' '.join(extra)} or " if extra else ""
            raise NbdistError(
                f"%dist_sync: nothing to sync in {_shown(entry)}: it holds no file, or every "
                f"file is left out (by {by}the default exclusions): sync a path with files in it"
            )
    manifests = {origin: _manifest(state, files) for origin, files in listings.items()}
    ranks = session.ranks
    writers = _writers(session, state, ranks)
    sent_files = sent_bytes = removed = 0
    changed: dict[str, list[str]] = {}
    for entry in entries:
        manifest = manifests[entry.origin]
        args = (state.token, entry.origin)
        looks = session.apply(
            synced_files.look, *args, manifest, state.copy, ranks=sorted(writers.values())
        )
        by_rank = dict(zip(sorted(writers.values()), looks, strict=True))
        entry.in_place = {key: by_rank[r]["in_place"] for key, r in writers.items()}
        copying = [r for r in sorted(by_rank) if not by_rank[r]["in_place"]]
        wanted = sorted({rel for r in copying for rel in by_rank[r]["missing"]})
        # Changed since the last sync (by content): what makes an imported module stale.
        if entry.last is not None:
            changed[entry.origin] = [
                rel
                for rel, v in manifest.items()
                if rel not in entry.last or entry.last[rel][2] != v[2]
            ]
        entry.last = manifest
        # Writers that lack the same files get the same messages; one with nothing to do
        # (up to date, nothing removed) gets none.
        groups: dict[tuple, list[int]] = {}
        removed_here = 0
        for r in copying:
            if by_rank[r]["missing"] or by_rank[r]["gone"]:
                groups.setdefault(tuple(by_rank[r]["missing"]), []).append(r)
        for missing, group in groups.items():
            chunks = list(_chunks(entry, manifest, missing)) or [{}]
            for i, chunk in enumerate(chunks):
                last = manifest if i == len(chunks) - 1 else None
                results = session.apply(synced_files.write, *args, chunk, last, ranks=group)
            removed_here = max(removed_here, *(gone for _, gone in results))
        removed += removed_here  # the same files on each machine: counted once per path
        sent_files += len(wanted)
        sent_bytes += sum(manifest[rel][0] for rel in wanted)
    synced = [state.entries[origin] for origin in state.order]
    paths = [(e.origin, e.in_place) for e in synced if e.in_place]
    results = session.apply(synced_files.activate, state.token, paths, changed, reload)
    modules: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for info, (_used, found) in zip(ranks, results, strict=True):
        for name, error in found:
            modules.setdefault(name, []).append(info.rank)
            if error:
                errors.setdefault(name, error)
    return SyncReport(
        paths=[_shown(e) for e in entries],
        files=sum(len(m) for m in manifests.values()),
        bytes=total,
        machines=len(writers),
        in_place=sum(1 for key in writers if all(e.in_place[key] for e in entries)),
        sent_files=sent_files,
        sent_bytes=sent_bytes,
        removed=removed,
        used={info.rank: used for info, (used, _) in zip(ranks, results, strict=True)},
        modules=modules,
        reloaded=reload,
        reload_errors=errors,
    )


def _chunks(entry: _Entry, manifest: dict, wanted):
    # {relative path: (bytes, sha256, executable)} at most _CHUNK_BYTES a message (a bigger
    # file goes alone).
    chunk: dict[str, tuple] = {}
    size = 0
    for rel in wanted:
        path = os.path.join(entry.origin, rel)
        with _readable(path), open(path, "rb") as f:
            data = f.read()
        if size and size + len(data) > _CHUNK_BYTES:
            yield chunk
            chunk, size = {}, 0
        sha = hashlib.sha256(data).hexdigest()
        if sha != manifest[rel][2]:
            raise NbdistError(
                f"%dist_sync: {path} changed while it was being synced: %dist_sync again"
            )
        chunk[rel] = (data, sha, os.access(path, os.X_OK))
        size += len(data)
    if chunk:
        yield chunk


def _writers(session, state: _State, ranks) -> dict[str, int]:
    # {machine key: its lowest rank}. Asked once per set of rank processes: the same
    # processes stay on the same machines (a restart gives new ones, and new PIDs).
    who = tuple((r.engine_id, r.pid) for r in ranks)
    if state.machines is None or state.machines[0] != who:
        state.machines = (who, session.apply(synced_files.machine_key))
    writers: dict[str, int] = {}
    for info, key in zip(ranks, state.machines[1], strict=True):
        writers.setdefault(key, info.rank)
    return writers


def resync(session) -> SyncReport | None:
    """After a restart (fresh ranks): the synced paths again, as they are now; the last report.

    Each path on its own: one that is gone or fails is a warning, the others are synced
    (the restart itself succeeded).
    """
    state = _STATES.get(session)
    if state is None or not state.entries:
        return None
    # Fresh processes: their machines are asked again (a full restart may give others).
    state.machines = None
    for entry in state.entries.values():
        entry.in_place = {}
    report = None
    for origin in list(state.order):
        entry = state.entries[origin]
        try:
            if not os.path.isdir(origin):
                raise NbdistError(f"%dist_sync: {_shown(entry)} is gone, so no longer synced")
            report = _sync(session, state, [entry], reload=False, max_bytes=MAX_BYTES)
        except (Exception, KeyboardInterrupt) as exc:  # told: the restart itself succeeded
            why = str(exc) if isinstance(exc, NbdistError) else f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"nbdist: {_shown(entry)} not synced again after the restart ({why}); "
                "%dist_sync it again once it can be",
                stacklevel=2,
            )
            state.order.remove(origin)
            del state.entries[origin]
    return report


def session_stopping(session, client) -> None:
    """Before the ranks stop: the session's copies removed on every machine (best effort, 10 s).

    Asked of every engine, not only the ranks that wrote: a rank of an earlier start, a
    kernel that attached to a named session and never synced. Removing is idempotent.
    """
    state = _STATES.get(session)
    name = getattr(session, "name", None)
    if state is not None:
        state.machines = None  # the next ranks are other processes
    token = state.token if state is not None else (f"named-{name}" if name else None)
    if token is None:
        return
    if client is not None and client.ids:
        try:
            client[list(client.ids)].apply_async(synced_files.remove_copies, token).get(10)
        except Exception:  # noqa: BLE001 - a dead or hung rank: prune() removes them later
            pass
    # This machine's copies go in any case: ranks that all died answer nothing, and
    # prune() runs only at a later %dist_sync, so they outlived the stop and the kernel.
    synced_files.remove_copies(token)
