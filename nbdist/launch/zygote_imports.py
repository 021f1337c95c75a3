"""Separate process (the engine zygote, before it forks): what it imports and prepares once.

Everything here runs in :mod:`nbdist.launch.zygote` before its first fork, so the
ranks share it copy-on-write instead of each paying for it: torch and
torch.distributed, ipyparallel's engine, the modules every engine imports as it
starts or at its first error (:data:`ENGINE_MODULES`), the caches IPython fills
when it formats a rank's first traceback, where many ranks start, torch's compiler
front end that DDP imports as it is built (:func:`dynamo_pays`), and, where many
ranks share each core, the torch sources those tracebacks read
(:data:`TRACEBACK_SOURCES`, :func:`parse_pays`). Nothing here starts a thread: the zygote checks
(:func:`nbdist.launch.zygote.fork_unsafe_reason`) before it forks.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENGINE_MODULES", "TRACEBACK_SOURCES", "dynamo_pays", "import_all", "parse_pays"]

# What every engine imports while it starts, besides torch and ipykernel's debugger
# module: imported once in the zygote, shared by the forks instead of paid per rank.
# None of them starts a thread at import; fork_unsafe_reason() checks.
ENGINE_MODULES = (
    "sqlite3",
    "IPython.extensions.storemagic",
    # Imported by each engine after registering (measured with -X importtime):
    "tornado.platform.asyncio",
    "IPython.core.oinspect",
    "IPython.core.completerlib",
    "argcomplete",
    # Imported by each engine at its first error, to format the traceback (IPython's
    # ultratb): with the walk below, ~20 ms of CPU a rank, in the cell that failed.
    "stack_data",
    "pygments.console",
    "pygments.formatters.terminal256",
    "pygments.styles",
    # Imported by each rank while the group forms.
    "nbdist.engine.bootstrap",  # with patches (every patch module), devices, netif, metrics.log
)


# From how many forks the zygote imports torch._dynamo (see dynamo_pays).
_DYNAMO_FROM = 8

# torch's modules whose frames most errors on a rank pass through (a collective's, a released
# collective's, a model's forward, a backward pass, a loss or activation function's shape check).
TRACEBACK_SOURCES = (
    "torch.distributed.distributed_c10d",
    "torch.distributed.c10d_logger",
    "torch.nn.modules.module",
    "torch._tensor",
    "torch.autograd",
    "torch.autograd.graph",
    "torch.nn.functional",
)
# From how many forks, and how many per core, the zygote parses them (see parse_pays).
_PARSE_SOURCES_FROM = 8
_PARSE_RANKS_PER_CORE = 4


def parse_pays(forks: int, cores: int) -> bool:
    """Whether parsing :data:`TRACEBACK_SOURCES` before forking ``forks`` ranks on ``cores`` pays.

    The parse costs the start ~1.4 CPU-s, serial, before the first fork. Each rank then
    saves 0.1-0.2 CPU-s the first time an error passes through one of those files
    (IPython's ``stack_data`` parses a frame's whole file once per process), in the cell
    that failed, on every rank at once. With a core per rank that is 0.1-0.2 s of wall
    time saved for ~1.4 s added to every start; with 4 ranks or more queueing per core it
    is seconds (64 ranks on 2 cores: the first error through ``nn.functional`` took
    7.0-7.3 s to report without its parse, 1.5 s with it; bench/RESULTS.md).
    """
    return forks >= _PARSE_SOURCES_FROM and forks >= _PARSE_RANKS_PER_CORE * max(1, cores)


def dynamo_pays(forks: int) -> bool:
    """Whether importing ``torch._dynamo`` before forking ``forks`` ranks pays.

    Building ``DistributedDataParallel`` imports it (torch 2.13: ~810 modules, sympy
    among them): each rank paid ~1 CPU-s and ~94 MiB of its own memory the first time,
    in the same cell on every rank at once. With 256 ranks that is ~23.5 GiB: on a
    24-GiB machine a cell that built a one-layer DDP had not ended after 15 minutes, and
    the out-of-memory killer had ended 60 ranks; at 64 ranks on 2 cores it took 36 s,
    0.7 s with the import shared (bench/first_ddp.py, 2026-12-05). Imported once here it
    costs the start ~0.5 CPU-s (the cyclic collector off); below 8 ranks the start is
    left alone: ~1 CPU-s a rank at the first DDP model, against ~0.5 s added to every
    start, also those that never build one (most of a test suite's).
    """
    return forks >= _DYNAMO_FROM


def import_all(forks: int = 1) -> None:
    """torch, torch.distributed, ipyparallel's engine, ipykernel's debugger module, the rest.

    What the forks share copy-on-write instead of importing each; called with
    Python's cyclic collector off (see :func:`nbdist.launch.zygote.main`). ``forks``: how many engines this
    zygote forks (:func:`parse_pays` decides on :func:`_parse_traceback_sources`).
    """
    import torch  # noqa: F401 - the point of the zygote: imported once, shared by forks
    import torch.distributed  # noqa: F401
    from ipyparallel.engine.app import IPEngine  # noqa: F401

    _import_debugger_module()
    _preimport(ENGINE_MODULES)
    _warm_traceback_caches()
    if dynamo_pays(forks):
        # No thread starts at its import (fork_unsafe_reason checks); torch.compile's
        # workers start at a first compile, in the rank.
        _preimport(("torch._dynamo",))
    if parse_pays(forks, _usable_cores()):
        _parse_traceback_sources(TRACEBACK_SOURCES)
        _format_one_traceback()


def _preimport(names) -> None:
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # an optional speed-up: the engine imports what it needs anyway
            pass


def _warm_traceback_caches() -> None:
    """Fill the cache IPython fills at a rank's first error, once, for every fork.

    Formatting a traceback maps each frame's file to its module: ``inspect.getmodule``
    first walks every module imported (torch's thousands, a ``realpath`` each) into
    ``inspect.modulesbyfile``, ~10 ms of CPU per engine, paid in the cell that failed:
    at 256 ranks over a second of a small machine's time, while other ranks still run.
    """
    import inspect

    try:
        # A file no module has: the walk runs (one of a module's would be found in the
        # cache torch's import began, and end it early).
        inspect.getmodule(compile("", "<nbdist warm-up>", "exec"))
    except Exception:  # an optional speed-up, as _preimport
        pass


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # a taskset or cpuset limit, where there is one
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _parse_traceback_sources(names) -> None:
    """Parse, as IPython does at a rank's first error through them, the modules ``names``.

    IPython's tracebacks read each frame's file with ``stack_data``, which parses and
    tokenizes the whole file once per process: an error through torch.distributed cost a
    rank 0.24 CPU-s the first time, 0.05 s with its files parsed here (a model's forward
    0.14 → 0.07 s, a second ``backward()`` 0.12 → 0.03 s, ``F.cross_entropy``'s shape
    check 0.16 → 0.03 s). 64 ranks released from a collective took 17.8 s to report it
    on 2 cores. Parsed once here (~1.4 CPU-s, ~75 MiB shared by every fork) where
    :func:`parse_pays`.
    """
    import importlib

    try:
        import stack_data

        for name in names:
            source = stack_data.Source.for_filename(importlib.import_module(name).__file__)
            source.pieces  # noqa: B018 - what the traceback reads, cached on the source
            source.tokens_by_lineno  # noqa: B018
    except Exception:  # an optional speed-up, as _preimport
        pass


def _format_one_traceback() -> None:
    """Format one traceback as an engine's IPython does, so the forks find its caches filled.

    The first traceback a process formats in colour compiles pygments' Python lexer, ~90
    regular expressions that Python's ``re`` module then keeps, and loads the lexer and
    the colour tables: 49 ms of CPU against 20 ms for the next one (the sources parsed
    already; this VM, 2026-12-06), paid by every rank at once in the cell that failed.
    """
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.core.ultratb import AutoFormattedTB

        theme = InteractiveShell.colors.default_value  # what an engine's shell formats with
        try:
            raise RuntimeError("nbdist warm-up")
        except RuntimeError:
            AutoFormattedTB(mode="Context", theme_name=theme).structured_traceback(*sys.exc_info())
    except Exception:  # an optional speed-up, as _preimport
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
