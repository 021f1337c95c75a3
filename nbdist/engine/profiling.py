"""Rank side: ``nbdist.profile``, torch.profiler over a few training steps, one Chrome trace per rank.

On every rank, around a training loop::

    with nbdist.profile(steps=3):            # skip 1 step, then record 3
        for step, (x, y) in enumerate(loader):
            ...
            nbdist.log(step=step, loss=loss)  # each call ends one step

**Steps.** Each ``nbdist.log`` call ends a step, so a loop that logs once per
step needs nothing more. A loop that logs less often (or not at all) calls
``prof.step()`` at the end of each step instead (``with nbdist.profile(steps=3)
as prof:``); from the first explicit ``prof.step()`` on, ``nbdist.log`` calls
no longer count. The schedule is torch's: the first ``skip`` steps (default 1)
are traced but thrown away (warm-up: the first step after the profiler starts
pays its set-up), the next ``steps`` are recorded; steps after those run
unprofiled. Leaving the block early keeps the steps recorded so far.

**The trace.** When the last recorded step ends (or the block is left), the
rank writes torch's Chrome trace (``export_chrome_trace``) to a temporary file
and keeps a record of it (:func:`ready`) until the kernel gathers it
(``%dist_profile``, :func:`nbdist.driver.trace_merge.collect`), which merges
every rank's trace into one and deletes the temporary files. Under plain
``torchrun`` the file is where ``Profile.trace_path`` says until the script exits.

``%dist_profile N`` calls :func:`arm` on the ranks: the next ``nbdist.log``
call starts a profile of the next N steps, without a ``with`` block.

How the steps reach this module: while a profile is armed or running,
:func:`on_log` is in ``nbdist.metrics.log.step_hooks``, which every
``nbdist.log`` call runs first, and :func:`on_cell_end` in
``nbdist.metrics.log.cell_end_hooks``, run at the end of every cell.

**A profile ends with its cell at the latest.** A profile still recording when
the cell that started it ends (the cell raised or was interrupted, or ran fewer
steps than asked) is stopped there, keeping the steps recorded so far: the
pause before the next cell is never recorded as a step. An armed
``%dist_profile`` that no ``nbdist.log`` call started yet stays armed.

**Which profiles belong together.** Each record carries its window in
wall-clock ns: from the profile's start to the end of the cell it ran in (or
its own end outside cells). The kernel merges the ranks' profiles whose
windows overlap, never one rank's profile of one cell with another rank's of
a later cell.

**Files.** A trace is written, mode 0600, inside a private (0700) temporary
directory; what the kernel never gathered is deleted when the rank exits.
"""

from __future__ import annotations

import atexit
import gzip
import os
import sys
import tempfile
import threading
import time
import warnings

from nbdist.engine.helpers import rank

__all__ = [
    "Profile",
    "arm",
    "disarm",
    "discard",
    "on_cell_end",
    "on_log",
    "profile",
    "read_trace",
    "ready",
]

# Traces larger than this travel to the kernel gzip-compressed (JSON compresses ~10x).
GZIP_ABOVE_BYTES = 1 << 20

_lock = threading.RLock()
_active: Profile | None = None  # the profile nbdist.log steps
_armed: dict | None = None  # %dist_profile's request, started by the next nbdist.log call
_ready: dict[int, dict] = {}  # sequence number -> record of a finished profile
_count = 0  # profiles started on this rank (numbers of this rank only)
_open: list[dict] = []  # records finished during the cell running now: their window ends with it
_files: set[str] = set()  # trace files written and not deleted yet (deleted at exit)


class Profile:
    """torch.profiler over ``skip`` + ``steps`` steps of this rank; a context manager.

    ``activities``: torch.profiler activities (default: CPU, and CUDA when a
    GPU is in use). ``record_shapes``, ``profile_memory``, ``with_stack``:
    passed to ``torch.profiler.profile``. After the block, ``trace_path`` is
    the Chrome trace and ``steps_recorded`` how many steps it holds.
    """

    def __init__(
        self,
        steps: int = 5,
        skip: int = 1,
        *,
        activities=None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ):
        """Profile ``steps`` steps after skipping ``skip``; nothing starts before ``__enter__``."""
        steps, skip = _whole(steps, "steps"), _whole(skip, "skip")
        if steps < 1 or skip < 0:
            raise ValueError(f"nbdist.profile: steps={steps} must be >= 1 and skip={skip} >= 0")
        self.steps, self.skip = steps, skip
        self.options = dict(
            activities=activities,
            record_shapes=record_shapes,
            profile_memory=profile_memory,
            with_stack=with_stack,
        )
        self.seq = 0
        self.seen = 0  # step ends seen
        self.explicit = False  # prof.step() was called: nbdist.log no longer counts
        self.done = False
        self.trace_path: str | None = None
        self.started_ns = 0
        self.stopped_at_cell_end = False  # stopped by on_cell_end, before its last step
        self.trace_data: str | bytes | None = None  # in a session: the trace, held in memory
        self.thread = 0  # the thread that started it: torch stops it there only
        self.stop_requested = False  # stop() from another thread: stops at its next step
        self.anchors: list[tuple[int, int]] = []  # (step number, time.time_ns() as it began)
        self._prof = None

    @property
    def steps_recorded(self) -> int:
        """Steps recorded and completed so far (a step cut short by the block's end is in the trace, not here)."""
        return max(0, min(self.seen - self.skip, self.steps))

    def __enter__(self) -> Profile:
        """Start the profiler; this rank's ``nbdist.log`` calls now end steps."""
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the profiler and write the trace (the steps recorded so far)."""
        self.stop()

    def start(self) -> None:
        """Start the profiler (``__enter__``); one profile runs at a time on a rank."""
        global _active, _count
        import torch
        from torch.profiler import ProfilerActivity, schedule

        with _lock:
            if _active is not None and not _active.done:
                raise RuntimeError(
                    "nbdist.profile: a profile is already running on this rank (one at a time)"
                )
            options = dict(self.options)
            if options["activities"] is None:
                options["activities"] = [ProfilerActivity.CPU]
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    options["activities"].append(ProfilerActivity.CUDA)
            # warmup=0 makes torch warn that results may skew; skip=0 was asked for, so hush it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sched = schedule(wait=0, warmup=self.skip, active=self.steps, repeat=1)
                self._prof = torch.profiler.profile(
                    schedule=sched, on_trace_ready=self._export, **options
                )
                self._prof.start()
            _count += 1
            self.seq = _count
            self.started_ns = time.time_ns()
            self.thread = threading.get_ident()
            self.anchors.append((0, self.started_ns))
            _active = self
            _install_hook()

    def step(self) -> None:
        """End one step explicitly (then ``nbdist.log`` calls stop counting)."""
        self.explicit = True
        self.end_step()

    def end_step(self) -> None:
        """One step ended (``nbdist.log`` or :meth:`step`): torch's schedule moves on."""
        if self.done or self._prof is None:
            return
        if self.stop_requested:
            self.stop()
            return
        self.seen += 1
        self._prof.step()
        # Taken after step() returned, so just after the ProfilerStep#n event began;
        # the kernel uses these only when the trace lacks baseTimeNanoseconds.
        self.anchors.append((self._prof.step_num, time.time_ns()))
        if self.seen >= self.skip + self.steps:
            self.stop()

    def stop(self) -> None:
        """Stop the profiler now (a window cut short keeps its steps); idempotent.

        From another thread than the one that started it (torch.profiler crashes
        there), the profile stops at that thread's next step instead.
        """
        global _active
        if self.thread and threading.get_ident() != self.thread:
            self.stop_requested = True
            return
        with _lock:
            prof, self._prof = self._prof, None
            if self.done or prof is None:
                return
            self.done = True
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter(
                        "ignore"
                    )  # "WARMUP followed by NONE": fewer steps than skip
                    prof.stop()
            finally:
                if _active is self:
                    _active = None
                self._record()
                _uninstall_hook()

    def _export(self, prof) -> None:
        # A private directory (0700): torch rewrites the file with the umask's mode.
        folder = tempfile.mkdtemp(prefix=f"nbdist-profile-rank{rank()}-")
        path = os.path.join(folder, "trace.json")
        _files.add(path)
        prof.export_chrome_trace(path)
        os.chmod(path, 0o600)
        self.trace_path = path
        if _in_session():
            # A session's rank ends with os._exit (no atexit): the trace waits for the
            # kernel in memory, and nothing of it outlives the rank.
            with open(path, "rb") as f:
                self.trace_data = _packed(f.read())
            _delete(path)

    def _record(self) -> None:
        record = {
            "seq": self.seq,
            "rank": rank(),
            "path": self.trace_path,
            "steps": self.steps,
            "skip": self.skip,
            "steps_recorded": self.steps_recorded if self.trace_path else 0,
            "anchors": self.anchors,
            "finished_ns": time.time_ns(),
            "stopped_at_cell_end": self.stopped_at_cell_end,
        }
        data = self.trace_data
        # Until the cell ends (on_cell_end), the window ends with the profile.
        record["window"] = [self.started_ns, record["finished_ns"]]
        _ready[self.seq] = dict(record, data=data) if data is not None else record
        _open.append(_ready[self.seq])
        if self.trace_path is None and not self.stopped_at_cell_end:
            warnings.warn(
                f"nbdist.profile saw {self.seen} step(s), fewer than skip={self.skip} + 1: nothing"
                " recorded. Steps end at each nbdist.log(...) call or prof.step()",
                stacklevel=3,
            )


def profile(steps: int = 5, skip: int = 1, **options) -> Profile:
    """``with nbdist.profile(steps=3):``: torch.profiler over the next steps; see :class:`Profile`."""
    return Profile(steps, skip, **options)


def on_log(step=None) -> None:
    """What each ``nbdist.log`` call does here: start an armed profile, or end a step. Never raises."""
    global _armed
    if _active is None and _armed is None:
        return
    try:
        with _lock:
            current = _active
            if current is None:
                request, _armed = _armed, None
                if request is not None:
                    Profile(**request).start()  # this call is the start of the first step
                return
        if not current.explicit:
            current.end_step()
    except Exception as exc:  # a broken profile must never break training
        warnings.warn(f"nbdist.profile stopped: {type(exc).__name__}: {exc}", stacklevel=2)
        _abandon()


def _abandon() -> None:
    global _active
    with _lock:
        current, _active = _active, None
        if current is not None:
            try:
                current.stop()
            except Exception:
                current.done = True
        _uninstall_hook()


def on_cell_end() -> None:
    """The cell on this rank ended (``nbdist.metrics.log.end_of_cell``): stop a profile it left running.

    Its steps so far are kept (the record says ``stopped_at_cell_end``); the
    windows of the profiles finished in this cell end now. Never raises.
    """
    try:
        with _lock:
            current = _active
            mine = current is not None and current.thread == threading.get_ident()
            if mine and not current.done:  # one started by a thread runs beyond the cell
                current.stopped_at_cell_end = True
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the kernel says what was kept
                    current.stop()
            now = time.time_ns()
            for record in _open:
                record["window"][1] = max(record["window"][1], now)
            _open.clear()
            _uninstall_hook()
    except Exception as exc:
        warnings.warn(f"nbdist.profile stopped: {type(exc).__name__}: {exc}", stacklevel=2)
        _abandon()


def arm(steps: int, skip: int = 1) -> dict:
    """Profile ``steps`` steps (after ``skip``) from the next ``nbdist.log`` call on (``%dist_profile``)."""
    global _armed
    with _lock:
        if _active is not None and not _active.done:
            raise RuntimeError("a profile is already running on this rank: %dist_profile --collect")
        Profile(steps, skip)  # checks the numbers
        _armed = {"steps": int(steps), "skip": int(skip)}
        _install_hook()
    return {"rank": rank(), "next_seq": _count + 1}


def disarm() -> dict:
    """Stop a running profile now and forget an armed one; what this rank holds (``--collect``)."""
    global _armed
    with _lock:
        _armed = None
        if _active is not None:
            _active.stop()
        _uninstall_hook()
    return {"rank": rank(), "ready": sorted(_ready)}


def ready() -> list[dict]:
    """Records of the finished profiles not yet gathered: seq, rank, path, steps_recorded, anchors, ...

    Also ``running``: whether a profile is armed or recording now.
    """
    with _lock:
        records = [{k: v for k, v in r.items() if k != "data"} for _, r in sorted(_ready.items())]
        running = _armed is not None or (_active is not None and not _active.done)
    for r in records:
        r["running"] = running
    return records or [{"seq": 0, "rank": rank(), "running": running}]


def _own(seq):
    """``seq``, or this rank's number in ``{rank: seq}`` (None: this rank has none)."""
    return seq.get(rank()) if isinstance(seq, dict) else seq


def read_trace(seq):
    """The Chrome trace of profile ``seq``: JSON text, or gzip bytes when over 1 MiB.

    ``seq``: a number, or ``{rank: number}`` (each rank reads its own; None where absent).
    """
    seq = _own(seq)
    if seq is None:
        return None
    record = _ready[seq]
    if record.get("data") is not None:
        return record["data"]
    with open(record["path"], "rb") as f:
        return _packed(f.read())


def _packed(data: bytes):
    if len(data) > GZIP_ABOVE_BYTES:
        return gzip.compress(data, compresslevel=1)  # level 1: fast, and most of the gain
    return data.decode("utf-8")


def _in_session() -> bool:
    """Whether this rank is an nbdist session's engine (an IPython kernel), not a script."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return get is not None and getattr(get(), "kernel", None) is not None


def discard(seq, older: bool = False) -> None:
    """Forget profile ``seq`` and delete its temporary file (after the kernel gathered it).

    ``seq``: a number or ``{rank: number}``; ``older``: also the profiles before
    it, which the kernel, merging the newest, will never gather.
    """
    seq = _own(seq)
    if seq is None:
        return
    with _lock:
        gone = [_ready.pop(n) for n in sorted(_ready) if n == seq or (older and n < seq)]
    for record in gone:
        _delete(record.get("path"))


def _delete(path: str | None) -> None:
    if not path:
        return
    _files.discard(path)
    for remove, what in ((os.unlink, path), (os.rmdir, os.path.dirname(path))):
        try:
            remove(what)
        except OSError:
            pass


@atexit.register
def _delete_all() -> None:
    """At the rank's exit: delete the traces the kernel never gathered."""
    for path in list(_files):
        _delete(path)


def _install_hook() -> None:
    from nbdist.metrics.log import cell_end_hooks, step_hooks

    if on_log not in step_hooks:
        step_hooks.append(on_log)
    if on_cell_end not in cell_end_hooks:
        cell_end_hooks.append(on_cell_end)


def _uninstall_hook() -> None:
    from nbdist.metrics.log import cell_end_hooks, step_hooks

    if _armed is not None or (_active is not None and not _active.done):
        return
    if on_log in step_hooks:
        step_hooks.remove(on_log)
    if on_cell_end in cell_end_hooks and not _open:
        cell_end_hooks.remove(on_cell_end)


def _whole(value, name: str) -> int:
    """A step count as an int (its text too); 2.5 or 'abc' refused naming ``name``."""
    import operator

    try:
        return int(value) if isinstance(value, str) else operator.index(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"nbdist.profile: {name}={value!r} is not a whole number: give e.g. {name}=5"
        ) from None
