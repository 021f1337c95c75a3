"""Separate process (the engine zygote): what it imports once before forking the engines.

torch, ipyparallel's engine, and the modules each engine would otherwise import
by itself while it registers and joins the group; shared copy-on-write by every
fork. :func:`import_all` is called with Python's cyclic collector off (see
:mod:`nbdist.launch.zygote`).
"""

from __future__ import annotations

import sys

__all__ = ["ENGINE_MODULES", "import_all"]

# What every engine imports while it starts, besides torch and ipykernel's debugger
# module: imported once in the zygote, shared by the forks instead of paid per rank.
# None of them starts a thread at import; zygote.fork_unsafe_reason() checks.
ENGINE_MODULES = (
    "sqlite3",
    "IPython.extensions.storemagic",
    # Imported by each engine after registering (measured with -X importtime):
    "tornado.platform.asyncio",
    "IPython.core.oinspect",
    "IPython.core.completerlib",
    "argcomplete",
    # Imported by each rank while the group forms.
    "nbdist.engine.bootstrap",  # with control, collectives, devices, helpers, netif, metrics.log
    "nbdist.engine.cell_reply",
)


def _preimport(names) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # an optional speed-up: the engine imports what it needs anyway
            pass


def _import_debugger_module() -> None:
    """Import ipykernel's debugger module without debugpy.

    ipykernel imports debugpy (~0.1 s, ~150 modules) for a debugger that an
    ipyparallel engine never enables (it has no debug channel; its log says
    "debugging will not be enabled"). Hidden while ipykernel looks, debugpy
    counts as missing there; afterwards a rank can still ``import debugpy``
    (e.g. ``debugpy.listen`` to attach an IDE to one rank).
    """
    import importlib

    hidden = "debugpy" not in sys.modules
    if hidden:
        sys.modules["debugpy"] = None  # makes "import debugpy" raise ImportError
    try:
        importlib.import_module("ipykernel.debugger")
    except Exception:  # an optional speed-up: the engine imports what it needs anyway
        pass
    finally:
        if hidden and sys.modules.get("debugpy", False) is None:
            del sys.modules["debugpy"]


def import_all() -> None:
    """torch, torch.distributed, ipyparallel's engine, ipykernel's debugger module, the rest."""
    import torch  # noqa: F401 - the point of the zygote: imported once, shared by forks
    import torch.distributed  # noqa: F401
    from ipyparallel.engine.app import IPEngine  # noqa: F401

    _import_debugger_module()
    _preimport(ENGINE_MODULES)
