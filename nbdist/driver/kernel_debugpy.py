"""Kernel side: the kernel's own debugpy (ipykernel's debugger) leaves the processes the kernel starts alone.

ipykernel's debugger starts debugpy in the kernel with debugpy's defaults, which
make every Python process the kernel starts from then on a debuggee too: the
ranks, controller and launcher of a ``%dist_start`` run with the debugger on
would start too slowly to register (the controller never wrote its connection
files). :func:`leave_children_alone` is called when nbdist puts its router in
front of the kernel's debugger (:func:`nbdist.driver.lab_debugger_cells.install`).
"""

from __future__ import annotations

__all__ = ["leave_children_alone"]


def leave_children_alone() -> None:
    """Make the processes this kernel starts from now on no debuggees of its debugpy.

    Before debugpy starts, configuring it is enough; once it has started (the
    debugger switched on before ``%load_ext nbdist``), its wrappers around the
    ways to start a process are put back to the originals it kept.
    """
    try:
        import debugpy
    except ImportError:
        return
    try:
        debugpy.configure(subProcess=False)
    except (RuntimeError, ValueError):
        pass
    import os
    import subprocess

    modules = [os, subprocess]
    try:
        import _posixsubprocess

        modules.append(_posixsubprocess)
    except ImportError:
        pass
    for module in modules:
        for name in [n for n in vars(module) if n.startswith("original_")]:
            function = name.removeprefix("original_")
            wrapper = getattr(module, function, None)
            if "pydev_monkey" in getattr(wrapper, "__module__", ""):
                setattr(module, function, getattr(module, name))
                delattr(module, name)
