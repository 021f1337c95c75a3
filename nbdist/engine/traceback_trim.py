"""Rank side: a rank's tracebacks end at the user's code, not in nbdist's SIGINT handler or debugpy.

A KeyboardInterrupt's traceback on a rank went on past the user's line where it
landed, through frames the user did not write:

- nbdist's own SIGINT handler (:class:`nbdist.engine.request_sigint.RequestSigint`),
  which raises it in Python where Python's own handler, C code, adds no frame: every
  interrupted cell ended in ``request_sigint.py``'s ``raise KeyboardInterrupt``, read
  as an error of nbdist's.
- debugpy's, on a rank paused at a breakpoint: a dozen frames of its wait, which
  IPython then read and highlighted (pydevd.py alone is 3,000 lines): 2.5 CPU-s a
  rank, 23 s before 64 paused ranks on 2 cores ended their cell, and a traceback
  whose last 20 lines were debugpy's. An exception raised in a trace function also
  enters the traced frame's line twice; once is kept.

:func:`install` wraps the rank shell's ``showtraceback``, through which both a cell's
and an ``apply``'s errors are reported, to cut the traceback there (in place: what
``sys.last_traceback`` and ``%debug`` see is the user's frames too).

Example (on a rank: what the engine's setup does)::

    from nbdist.engine import traceback_trim
    traceback_trim.install(get_ipython())
"""

from __future__ import annotations

import os
import sys

from nbdist.engine.request_sigint import RequestSigint

__all__ = ["install", "trim"]


def install(shell) -> None:
    """Cut the tracebacks ``shell`` reports at nbdist's SIGINT handler and debugpy (idempotent)."""
    show = shell.showtraceback
    if getattr(show, "nbdist_original", None) is not None:
        return

    def showtraceback(exc_tuple=None, *args, **kwargs):
        value = (exc_tuple or sys.exc_info())[1]
        trim(getattr(value, "__traceback__", None))
        return show(exc_tuple, *args, **kwargs)

    showtraceback.nbdist_original = show
    shell.showtraceback = showtraceback


def trim(tb) -> None:
    """Cut traceback ``tb`` (in place) before its first frame of nbdist's SIGINT handler or of
    debugpy's own code; a line entered twice in a row (a trace function raised) once.

    The first entry stays whatever it is: a traceback is never emptied.
    """
    previous = None
    while tb is not None:
        if previous is not None and _not_the_users(tb.tb_frame.f_code):
            previous.tb_next = None
            return
        repeat = previous is not None and (tb.tb_frame, tb.tb_lineno) == (
            previous.tb_frame,
            previous.tb_lineno,
        )
        if repeat:
            previous.tb_next = tb.tb_next
        else:
            previous = tb
        tb = tb.tb_next


def _not_the_users(code) -> bool:
    if code is RequestSigint.__call__.__code__:
        return True
    filename = code.co_filename
    return "pydevd" in filename or f"{os.sep}debugpy{os.sep}" in filename
