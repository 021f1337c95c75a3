"""Kernel side (read by the Jupyter server too): the run history, every logged point, in SQLite,
readable after the kernel is gone.

Location: ``$NBDIST_HISTORY`` if set, else ``<jupyter data dir>/nbdist/history.sqlite``
(``jupyter --data-dir`` shows it; typically ``~/.local/share/jupyter``).
One run per session start. WAL mode lets a dashboard or the JupyterLab
sidebar read while the kernel writes.

Example::

    import nbdist
    run = nbdist.runs()[-1]          # the latest run, also after a kernel restart
    df = run.to_pandas()             # one row per (rank, step), a column per metric
"""

from __future__ import annotations

import json
import numbers
import os
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass

from nbdist.metrics.run import Run
from nbdist.metrics.wire import batch_columns, concat

__all__ = ["RunRecord", "RunStore", "history_path", "load_run", "pick_run", "run_version", "runs"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started REAL NOT NULL,
    ended REAL,
    world_size INTEGER NOT NULL,
    backend TEXT NOT NULL DEFAULT '',
    label TEXT NOT NULL DEFAULT '',
    host TEXT NOT NULL DEFAULT '',
    pid INTEGER NOT NULL DEFAULT 0
);
-- One row per flush of one rank: the message as the rank sent it, JSON with its
-- points as [step, time, {key: value}] (a bare JSON list also reads), so storing
-- costs one insert per message, not one per value (~16 us per point that way).
CREATE TABLE IF NOT EXISTS batches (
    run INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    seq INTEGER NOT NULL,     -- arrival order of the batch on its rank
    n INTEGER NOT NULL,       -- points in the batch
    points TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS batches_by_run ON batches (run, rank, seq);
"""


def history_path() -> str:
    """Where the run history lives (see the module docstring)."""
    explicit = os.environ.get("NBDIST_HISTORY")
    if explicit:
        return explicit
    from jupyter_core.paths import jupyter_data_dir

    return os.path.join(jupyter_data_dir(), "nbdist", "history.sqlite")


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at checkpoints, fast
        # One transaction: a reader sees no table or every one, never runs without batches.
        conn.executescript(f"BEGIN;{_SCHEMA}COMMIT;")
    return conn


class RunStore:
    """Writer of one kernel's runs (the collector thread appends, the session opens/closes)."""

    def __init__(self, path: str | None = None):
        """Open (creating it if needed) the history at ``path``, by default :func:`history_path`."""
        # Absolute: the Jupyter server (the sidebar) and other kernels read the history
        # from the path this kernel registers, each from a working directory of its own.
        self.path = os.path.abspath(path or history_path())
        self._conn = _connect(self.path)
        self._lock = threading.Lock()
        self._seq: dict[tuple[int, int], int] = {}

    def new_run(self, *, world_size: int, backend: str = "", label: str = "") -> Run:
        """Record a run starting now (with this host and PID); returns it, empty, with its new id."""
        started = time.time()
        with self._lock, self._conn:
            cur = self._conn.execute(
                "INSERT INTO runs (started, world_size, backend, label, host, pid) VALUES (?,?,?,?,?,?)",
                (started, world_size, backend, label, socket.gethostname(), os.getpid()),
            )
        return Run(
            cur.lastrowid, world_size=world_size, backend=backend, started=started, label=label
        )

    def append(self, run_id: int, rank: int, points: list | str, n: int | None = None) -> None:
        """Store one batch of ``[step, time, {key: value}]`` points of one rank.

        ``points`` may be JSON text as it arrived (the message, or the bare list),
        with ``n`` the number of points in it.
        """
        if not isinstance(points, str):
            n, points = len(points), json.dumps(points, separators=(",", ":"))
        with self._lock:
            # Under the lock: the collector thread and mark_restart (the main thread) both
            # append, and two batches of one rank must not get the same seq.
            seq = self._seq.get((run_id, rank), 0)
            self._seq[(run_id, rank)] = seq + 1
            # Not committed here: a commit per message cost more than the insert
            # itself; the collector commits when it has drained its socket.
            self._conn.execute(
                "INSERT INTO batches VALUES (?,?,?,?,?)", (run_id, rank, seq, n, points)
            )

    def commit(self) -> None:
        """Make the batches appended so far visible to readers of the history."""
        with self._lock:
            self._conn.commit()

    def end_run(self, run_id: int) -> None:
        """Record now as the end time of run ``run_id`` (committed)."""
        with self._lock, self._conn:
            self._conn.execute("UPDATE runs SET ended=? WHERE id=?", (time.time(), run_id))

    def close(self) -> None:
        """Commit what was appended and close the database."""
        with self._lock:
            self._conn.commit()
            self._conn.close()


@dataclass(frozen=True)
class RunRecord:
    """A run in the history; :meth:`load` reads its points."""

    id: int
    started: float
    ended: float | None
    world_size: int
    backend: str
    label: str
    host: str
    points: int
    path: str

    def load(self) -> Run:
        """This run with all its points, read from its history file (:func:`load_run`)."""
        return load_run(self.id, path=self.path)

    def to_pandas(self):
        """One row per (rank, step): rank, step, time and a column per metric."""
        return self.load().to_pandas()


def runs(path: str | None = None) -> list[RunRecord]:
    """Every run in the history, oldest first (an empty list if there is none yet)."""
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"runs: path={path!r}: give the history file's path (e.g. 'runs.db', as passed to "
            "DistSession(history=...)), or leave it out for the default history"
        )
    path = os.fspath(path) if path else history_path()
    if os.path.isdir(path):
        raise ValueError(
            f"runs: {path!r} is a directory: give the history file itself (one SQLite file, "
            f"e.g. {os.path.join(path, 'history.sqlite')!r})"
        )
    if not os.path.exists(path):
        return []
    conn = _connect(path, readonly=True)
    try:
        for attempt in range(2):
            try:
                rows = conn.execute(_RUNS_QUERY).fetchall()
                break
            except sqlite3.DatabaseError as exc:
                # A kernel creating the history makes the file a moment before its tables:
                # read then, it is an empty history (the sidebar asks every few seconds), not
                # a wrong file. The tables may also come between the failed read and this
                # look (~1 in 10 reads racing a creation, 2026-12-04): read once more.
                if _no_tables(conn):
                    return []
                if attempt == 0:
                    continue
                raise ValueError(
                    f"runs: {path!r} is no nbdist run history ({exc}): give the file a session "
                    "wrote, or leave path out for the default history"
                ) from None
    finally:
        conn.close()
    return [RunRecord(*row, path=path) for row in rows]


_RUNS_QUERY = (
    "SELECT r.id, r.started, r.ended, r.world_size, r.backend, r.label, r.host,"
    " (SELECT COALESCE(SUM(n), 0) FROM batches b WHERE b.run = r.id)"
    " FROM runs r ORDER BY r.id"
)


def _no_tables(conn: sqlite3.Connection) -> bool:
    try:
        return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
    except sqlite3.DatabaseError:  # not SQLite at all
        return False


def load_run(run_id: int, *, path: str | None = None) -> Run:
    """A finished (or running) run read back from the history."""
    path = path or history_path()
    if isinstance(run_id, bool) or not isinstance(run_id, numbers.Integral):
        raise TypeError(
            f"run id {run_id!r} (a {type(run_id).__name__}): give the run's number, e.g. "
            "load_run(3); nbdist.runs() lists them"
        )
    run_id = int(run_id)  # NumPy's integers too (a DataFrame's column)
    # SQLite integers are 64-bit; and no history file yet means no run in it.
    if not 0 <= run_id < 2**63 or not os.path.exists(path):
        raise KeyError(f"run {run_id} is not in the history at {path}: see nbdist.runs()")
    conn = _connect(path, readonly=True)
    try:
        meta = conn.execute(
            "SELECT started, ended, world_size, backend, label FROM runs WHERE id=?", (run_id,)
        ).fetchone()
        if meta is None:
            raise KeyError(f"run {run_id} is not in the history at {path}: see nbdist.runs()")
        rows = conn.execute(
            "SELECT rank, points FROM batches WHERE run=? ORDER BY rank, seq", (run_id,)
        ).fetchall()
    finally:
        conn.close()
    started, ended, world_size, backend, label = meta
    run = Run(
        run_id, world_size=world_size, backend=backend, started=started, ended=ended, label=label
    )
    by_rank: dict[int, list] = {}
    for rank, text in rows:
        message, batch = batch_columns(json.loads(text))
        # The rank's running count of points it could not send rides on its messages.
        run.record_losses(rank, message)
        by_rank.setdefault(rank, []).append(batch)
    for rank, batches in by_rank.items():
        run.add_columns(rank, *concat(batches))
    return run


def pick_run(run_id: int | None = None, *, current: Run | None = None, path=None) -> Run:
    """The run a dashboard shows: run ``run_id``, else ``current``, else the history's latest.

    ``current``: the session's own run (kept in memory, also when no history is
    written), used whenever it is the one asked for. Raises ``LookupError`` with
    the words for the user when there is no such run, or no run at all.
    """
    if current is not None and (run_id is None or current.id == run_id):
        return current
    if run_id is not None:
        return load_run(run_id, path=path)
    history = runs(path)
    if not history:
        raise LookupError("no runs yet: %dist_start, then log with nbdist.log(...) on the ranks")
    return history[-1].load()


def run_version(run_id: int, *, path: str | None = None) -> tuple | None:
    """What changes whenever run ``run_id``'s stored record or points change; None if no such run.

    ``(started, ended, batches, last batch rowid)``, read from the index alone (no
    point is decoded): a reader that cached something built from :func:`load_run`
    compares it to know the run is unchanged (a finished run stays so). Batches are
    only ever appended, and a history file made anew gives its runs other start times.
    """
    path = path or history_path()
    if not (isinstance(run_id, int) and 0 <= run_id < 2**63) or not os.path.exists(path):
        return None
    conn = _connect(path, readonly=True)
    try:
        conn.execute("BEGIN")  # one snapshot for both queries
        meta = conn.execute("SELECT started, ended FROM runs WHERE id=?", (run_id,)).fetchone()
        if meta is None:
            return None
        count, last = conn.execute(
            "SELECT COUNT(*), COALESCE(MAX(rowid), 0) FROM batches WHERE run=?", (run_id,)
        ).fetchone()
    finally:
        conn.close()
    return (*meta, count, last)
