"""Rank side: what a rank's forked children print reaches the notebook, labelled with the rank.

A DataLoader worker, a ``multiprocessing`` process started by fork, any ``os.fork()``
child: its ``print`` writes to the ``sys.stdout`` it inherited, ipykernel's stream of
the engine, which in a child sends through the IO-pub socket of its parent. A zmq socket
does not survive a fork, so those lines were lost, with no error (a worker's warning
about a bad sample, a debugging print in a ``Dataset``). Jupyter's own kernel avoids it
with a pipe: its IO-pub thread listens on a loopback port, a forked child's stream sees
that it is a child and sends there, and the parent publishes what arrives, under the
cell that was running at the fork (so a child forked in an earlier cell, such as a
persistent DataLoader worker, prints under that cell: once it ended, the kernel shows
those lines as what the ranks printed after it, :mod:`nbdist.driver.late_output`). ipyparallel's engine makes its IO-pub thread without
that pipe; :func:`install` opens it on the engine's IO-pub thread, as the kernel does.

In a child, ipykernel's stream sends each ``write`` at once: two DataLoader workers'
``print`` calls (text, then the newline: two writes) arrived interleaved as
``worker itemworker item  20``. A child's stream here sends whole lines, as a terminal
shows them; the last partial line goes when the child flushes (``flush=True``, or the
flush ``multiprocessing`` makes at a child's end).

A child's line travels on a socket of its own, so it could reach the engine after the
cell's end; a child joined at the very end of the cell had its line in that cell's output
80 times of 80 (2 ranks, 40 cells, `print` in a fork ``Process`` as the cell's last
statement, on a loaded 2-core machine). What a child prints after its cell ended belongs
to that cell, and is shown under it as late output (:mod:`nbdist.driver.late_output`).

What the children write below Python (``os.system``, a subprocess's own output, C
libraries) goes to the process's file descriptors, which ipykernel already forwards.

The pipe listens on ``127.0.0.1`` only, on a port the system picks, and its messages must
carry a random key the children inherit (ipykernel's scheme, the same as in any Jupyter
kernel). A child started by spawn or forkserver is a new interpreter: its output goes
through the file descriptors.

Example (on a rank)::

    >>> import multiprocessing as mp
    >>> p = mp.get_context("fork").Process(target=print, args=("from a child",))
    >>> p.start(); p.join()
    [rank 1] from a child
"""

from __future__ import annotations

import os
import sys
import threading

__all__ = ["install", "pipe_open"]

# How long install waits for the IO-pub thread to open the pipe (its loop is idle at start).
_OPEN_WAIT_S = 5.0


def pipe_open(iopub_thread) -> bool:
    """Whether forked children's output on ``iopub_thread`` goes through the pipe."""
    # ipykernel's own flag (IOPubThread(pipe=True) in Jupyter's kernel); no public reader.
    return bool(getattr(iopub_thread, "_pipe_flag", False))


def install(kernel) -> bool:
    """Open the children's pipe on the engine ``kernel``'s IO-pub thread (idempotent).

    True when the pipe is open. False where the kernel has no ipykernel IO-pub thread or
    the loopback port could not be bound (ipykernel then warns "Couldn't bind IOPub Pipe",
    and children's prints are lost as before).
    """
    thread = getattr(kernel, "iopub_thread", None) or getattr(kernel, "iopub_socket", None)
    if thread is None or not hasattr(thread, "_setup_pipe_in") or not hasattr(thread, "schedule"):
        return False
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "pub_thread", None) is thread:
            _whole_lines_in_children(stream)
    if pipe_open(thread):
        return True
    opened = threading.Event()

    def open_pipe() -> None:
        # What IOPubThread(pipe=True) does at its start; ipykernel has no public way later.
        try:
            thread._pipe_flag = True  # noqa: SLF001 - _setup_pipe_in unsets it if the bind fails
            thread._setup_pipe_in()  # noqa: SLF001
        except Exception:
            thread._pipe_flag = False  # noqa: SLF001
            raise
        finally:
            opened.set()

    # The pipe's stream belongs to the IO-pub thread's own event loop: opened there.
    thread.schedule(open_pipe)
    opened.wait(_OPEN_WAIT_S)
    return pipe_open(thread)


def _whole_lines_in_children(stream) -> None:
    """Make ``stream`` (ipykernel's) send whole lines when written in a forked child (idempotent).

    In the engine's own process nothing changes: its IO-pub thread gathers writes already.
    """
    # Marked on flush: while a cell runs, IPython's history wraps write (and puts it back after).
    if getattr(stream.flush, "nbdist_original", None) is not None:
        return
    write, flush = stream.write, stream.flush
    parent = os.getpid()
    held = {"pid": parent, "text": ""}  # a child's partial line, by the pid that wrote it

    def write_lines(text: str):
        pid = os.getpid()
        if pid == parent or not isinstance(text, str):
            return write(text)
        if held["pid"] != pid:  # a child of a child, or the first write of this child
            held["pid"], held["text"] = pid, ""
        pending = held["text"] + text
        whole, newline, rest = pending.rpartition("\n")
        held["text"] = rest
        if newline:
            write(whole + newline)
        return len(text)

    def flush_lines() -> None:
        if os.getpid() != parent and held["pid"] == os.getpid() and held["text"]:
            text, held["text"] = held["text"], ""
            write(text)
        flush()

    write_lines.nbdist_original = write
    flush_lines.nbdist_original = flush
    # Instance attributes: print() and the children's own flush look them up on the stream.
    stream.write = write_lines
    stream.flush = flush_lines
