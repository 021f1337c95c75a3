"""Kernel side: nbdist's IPython magics, a thin face over the public API, one module per group.

Each magic parses its flags, makes one call on :class:`nbdist.DistSession` (or
the library function named in its help) and shows the result; everything a magic
does can be done from a script. Bad input raises IPython's ``UsageError`` naming
the value and the fix, and changes nothing. ``%dist_start?`` (or ``%dist_start --help``)
and the others' help texts are the manual.

- :mod:`~nbdist.magics.lifecycle`: ``%dist_start``, ``%dist_stop``, ``%dist_restart``,
  ``%dist_status``; its ``DistMagics`` holds the notebook's session, which every other
  group reaches through it.
- :mod:`~nbdist.magics.cells`: ``%%on_all_ranks``, ``%%on_rank``, ``%dist_push``,
  ``%dist_pull`` (running code, moving values).
- :mod:`~nbdist.magics.inspect`: ``%dist_where``, ``%dist_dashboard``, ``%dist_diff``,
  ``%dist_profile`` (looking at the ranks).
- :mod:`~nbdist.magics.debug`: ``%dist_debug``, ``%dist_debugpy``, ``%dist_last_error``.
- :mod:`~nbdist.magics.perf`: ``%dist_bench``.
- :mod:`~nbdist.magics.named_sessions`: ``%dist_sessions``, ``%dist_attach`` (sessions
  that outlive the kernel).
- :mod:`~nbdist.magics.scripts`: ``%dist_sync``, ``%dist_run``, ``%dist_export`` (files to the
  ranks' machines, torchrun scripts in and out).
- :mod:`~nbdist.magics.args`: how every magic reads its line, and the flags several share.

IPython is imported only when the magics are registered (``%load_ext nbdist``).
"""

from __future__ import annotations

__all__ = ["register"]


def register(ipython):
    """Register nbdist's magics on ``ipython`` (what ``%load_ext nbdist`` does); returns ``DistMagics``.

    Example::

        from IPython import get_ipython
        from nbdist.magics import register

        magics = register(get_ipython())
        magics.session          # the session %dist_start started, or None
    """
    from nbdist.driver.lab_debugger_cells import install as install_lab_debugger
    from nbdist.magics.cells import CellMagics
    from nbdist.magics.debug import DebugMagics
    from nbdist.magics.inspect import InspectMagics
    from nbdist.magics.lifecycle import DistMagics
    from nbdist.magics.named_sessions import NamedMagics
    from nbdist.magics.perf import PerfMagics
    from nbdist.magics.scripts import ScriptMagics

    # JupyterLab's debugger reaches the ranks through the kernel's debug requests.
    install_lab_debugger(ipython)
    magics = DistMagics(ipython)
    ipython.register_magics(magics)
    for more in (CellMagics, ScriptMagics, DebugMagics, InspectMagics, PerfMagics, NamedMagics):
        ipython.register_magics(more(ipython, magics))
    return magics
