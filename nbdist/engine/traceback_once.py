"""Rank side: a failed cell's traceback is formatted once, for the notebook and IPython's history alike.

IPython 9 formats a failed cell's traceback twice: to show it (``showtraceback``), then again,
the same way, to keep in its history (``_format_exception_for_storage``, for every cell that
stores history: one ending in an expression, as most do). Formatting is most of what an error
costs a rank: ``stack_data`` reads each frame's scope and pygments highlights it. A rank
failing the same cell over and over spent 89 % of its time formatting, half of it the second
time (py-spy, 2 ranks, this VM, 2026-12-06). Many ranks failing together on few cores (a
released collective on 64 or 256 ranks) wait for all of it.

:func:`install` wraps the rank shell's ``_showtraceback`` to remember the traceback it has just
sent, and ``_format_exception_for_storage`` to give that same text for the same exception
(an exception with its own ``_render_traceback_`` included: IPython renders it so both times).
Left to IPython: syntax errors and SystemExit (shown otherwise than stored), exception groups
(printed without ``_showtraceback``), and a shell without these methods.

Example (on a rank: what the engine's setup does)::

    from nbdist.engine import traceback_once
    traceback_once.install(get_ipython())
"""

from __future__ import annotations

__all__ = ["install"]

# Shown otherwise than stored: a syntax error's caret against its traceback, SystemExit as its
# message only ("An exception has occurred, use %tb to see the full traceback").
_FORMATTED_OTHERWISE = (SyntaxError, SystemExit)


def install(shell) -> None:
    """Keep ``shell``'s history from formatting again a traceback it has just shown (idempotent)."""
    store = getattr(shell, "_format_exception_for_storage", None)
    show = getattr(shell, "_showtraceback", None)
    if store is None or show is None or getattr(store, "nbdist_original", None) is not None:
        return
    # The exception last shown and its formatted lines; held until the history takes it or the
    # next error replaces it (IPython's sys.last_value holds the exception as long anyway).
    shown: list = []

    def _showtraceback(etype, evalue, stb, *args, **kwargs):
        shown[:] = [evalue, stb]
        return show(etype, evalue, stb, *args, **kwargs)

    def _format_exception_for_storage(exception, *args, **kwargs):
        if shown and shown[0] is exception and not isinstance(exception, _FORMATTED_OTHERWISE):
            stb = shown[1]
            shown.clear()
            return {"ename": type(exception).__name__, "evalue": str(exception), "traceback": stb}
        return store(exception, *args, **kwargs)

    _showtraceback.nbdist_original = show
    _format_exception_for_storage.nbdist_original = store
    # Both are IPython's (ipykernel's shell overrides the first to send the error): no public
    # hook sees the traceback text or makes the history's record.
    shell._showtraceback = _showtraceback  # noqa: SLF001 - the lines sent to the notebook
    shell._format_exception_for_storage = _format_exception_for_storage  # noqa: SLF001
