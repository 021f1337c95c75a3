"""Kernel side: where a rank was in Python when it died of a fatal signal, from faulthandler's record.

A rank that dies of a segmentation fault (or SIGABRT, SIGBUS, SIGFPE, SIGILL)
in native code says nothing itself; "crashed: segmentation fault in native
code" alone leaves the user to guess which line of which cell. Each rank the
zygote forks has faulthandler write every thread's Python stack to a file of
its own (:func:`nbdist.launch.zygote.read_crash`); :func:`summary` turns that
dump into one line for the rank's death: the innermost frames and the cell line
that led there.

The thread that crashed is faulthandler's "Current thread". A crash in a thread
with no Python frames (gloo's and NCCL's own threads) has none: the thread
running the cell is then the one whose stack passes through IPython's
``run_code``, and the words say that it was waiting there.

Example::

    >>> summary('''Fatal Python error: Segmentation fault
    ...
    ... Current thread 0x00007f (most recent call first):
    ...   File "/usr/lib/python3.12/ctypes/__init__.py", line 530 in string_at
    ...   File "/tmp/ipykernel_77/3141.py", line 3 in <module>
    ...   File "/venv/lib/python3.12/site-packages/IPython/core/interactiveshell.py", line 3577 in run_code
    ... ''')
    'in string_at (ctypes/__init__.py:530), from the cell, line 3'
"""

from __future__ import annotations

import re

from nbdist.engine.control import runs_cell

__all__ = ["ABORTED_IN_COLLECTIVE", "crash_words", "summary"]

# How many of the innermost frames the line names (the cell's line comes on top).
INNERMOST = 3
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$')
_HEADER = re.compile(r"^(?P<current>Current thread|Thread) 0x[0-9a-f]+")
_LIB = re.compile(r".*/(?:site-packages|dist-packages|lib/python3\.\d+)/")
_FATAL = re.compile(r"^Fatal Python error: (?P<what>.+)$", re.MULTILINE)
_COLLECTIVES = "torch/distributed/"
# What aborts a rank from a thread of its own while its cell waits in a collective. gloo's
# receiving rank, given more bytes than its tensor holds (a peer's tensor of another size
# or dtype in the same call), ends the process (an all_reduce of float64 on rank 1 and
# float32 on rank 0 aborted rank 0, the rank whose tensor was right); NCCL's watchdog does
# when a call outlasts the group's timeout. The rank that died need not be the one whose
# tensor differs, so the words point to the check that names it.
ABORTED_IN_COLLECTIVE = (
    "gloo aborts a rank this way when a peer's tensor in the same call has another size or "
    "dtype, whichever rank's differs (%dist_start --check-collectives names it before the "
    "call), and NCCL's watchdog when a call outlasts the group's timeout"
)


def _threads(dump: str) -> list[tuple[bool, list[tuple[str, int, str]]]]:
    """[(is the current thread, [(file, line, function), innermost first])] of the last dump."""
    # One record can hold several dumps (an earlier fatal error the rank survived, as
    # faulthandler.dump_traceback writes, say): the rank's death is the last.
    last = dump.rfind("Fatal Python error")
    threads: list[tuple[bool, list[tuple[str, int, str]]]] = []
    for line in dump[max(last, 0) :].splitlines():
        header = _HEADER.match(line)
        if header:
            threads.append((header["current"] == "Current thread", []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append((frame["file"], int(frame["line"]), frame["func"]))
    return threads


def _is_cell(path: str) -> bool:
    # ipykernel compiles each cell to /tmp/ipykernel_<pid>/<hash>.py; IPython alone: <ipython-input-...>.
    return "/ipykernel_" in path or path.startswith("<ipython-input")


def _short(path: str) -> str:
    return _LIB.sub("", path)


def _frame(path: str, line: int, func: str) -> str:
    # A function defined in a cell: its file is the cell's, which says nothing to the user.
    return f"{func} (a cell, line {line})" if _is_cell(path) else f"{func} ({_short(path)}:{line})"


def summary(dump: str) -> str:
    """One line: where the crashed thread (or the cell's thread) was; '' if the dump names nothing."""
    threads = [t for t in _threads(dump) if t[1]]
    if not threads:
        return ""
    current = next((frames for is_current, frames in threads if is_current), None)
    if current is None:
        running = next(
            (frames for _, frames in threads if any(runs_cell(func, f) for f, _, func in frames)),
            None,
        )
        if running is None:  # a thread of gloo's or NCCL's, between cells
            return "in a thread without Python frames, while no cell was running"
        frames = running
    else:
        frames = current
    # The running cell's frame is the outermost of the cell files (a function defined in
    # an earlier cell is one too); the frames below it (IPython's) say nothing to the user.
    cells = [i for i, (f, _, _) in enumerate(frames) if _is_cell(f)]
    cell_at = cells[-1] if cells else None
    inner = frames[: cell_at if cell_at is not None else INNERMOST][:INNERMOST]
    parts = [_frame(*frame) for frame in inner]
    words = "in " + " <- ".join(parts) if parts else ""
    if cell_at is not None:
        cell = f"the cell, line {frames[cell_at][1]}"
        words = f"{words}, from {cell}" if words else f"in {cell}"
    if current is None:
        words = f"a thread without Python frames crashed while the cell's thread was {words}"
        if _last_fatal(dump) == "Aborted" and any(_COLLECTIVES in f for f, _, _ in frames):
            words += f": {ABORTED_IN_COLLECTIVE}"
    return words


def _last_fatal(dump: str) -> str:
    """The rank's death in ``dump`` ('Segmentation fault', 'Aborted'); '' if none is recorded."""
    fatal = list(_FATAL.finditer(dump))
    return fatal[-1]["what"].strip() if fatal else ""


def crash_words(dump: str) -> str:
    """For a rank whose exit status is not known: 'crashed: <what>, <where>' if ``dump`` records
    a fatal error, else ''.

    Example::

        >>> crash_words('''Fatal Python error: Segmentation fault
        ...
        ... Current thread 0x00007f (most recent call first):
        ...   File "/tmp/ipykernel_77/3141.py", line 3 in <module>
        ... ''')
        'crashed: Segmentation fault, in the cell, line 3'
        >>> crash_words("")
        ''
    """
    what = _last_fatal(dump)
    if not what:
        return ""
    where = summary(dump)
    return f"crashed: {what}, {where}" if where else f"crashed: {what}"
