"""Rank side: the refusal of launchers that would start processes of their own inside a rank.

On a rank, nbdist's ranks already are the processes that ``torch.multiprocessing.spawn``,
Lightning's ``ddp_notebook`` / ``ddp_fork`` / ``ddp_spawn`` strategies or accelerate's
``notebook_launcher`` would start, and the process group is formed. Started inside a
rank, such a launcher makes N more processes per rank that try to form a group of their
own on the same address: they hang, and forked children outlive the engine. Or the
child cannot find a function defined in a cell (``Can't get attribute 'worker' on
<module '__main__'>``), and nothing says why.

:func:`install` (called on every rank when it joins the group) makes each of them
fail at once with :class:`LaunchInsideRank`, which names the launcher and the call that
works on the ranks as they are:

- ``torch.multiprocessing.spawn`` and ``start_processes`` (what Lightning's
  multiprocessing launcher and accelerate's ``debug_launcher`` call): call the worker
  directly, ``worker(rank, *args)``; for Lightning, ``strategy="ddp"``.
- ``torch.distributed.launcher.api.launch_agent`` (torchrun's elastic agent, which
  accelerate's ``notebook_launcher`` and ``torch.distributed.run`` start): call the
  training function directly on every rank.

Processes that do not join a process group (a pool of helpers) may still be started
that way inside ``with allow_launchers(): ...``.

Plain ``multiprocessing`` works on a rank with the "fork" start method (Linux's
default before Python 3.14), functions defined in cells included. With "spawn" or
"forkserver" a child imports ``__main__`` afresh, where cells' definitions do not exist;
a ``Process`` whose target (or a function among its arguments) was defined in a cell
fails at once with :class:`CellFunctionInChild` instead of dying in the child.

Example (on a rank)::

    >>> torch.multiprocessing.spawn(worker, args=(10,), nprocs=2)
    LaunchInsideRank: torch.multiprocessing.spawn (mp.spawn) would start 2 processes of its own ...
    >>> worker(rank, 10)        # what runs instead: this rank is one of those processes
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import os
import sys
import threading

__all__ = [
    "CellFunctionInChild",
    "LaunchInsideRank",
    "allow_launchers",
    "install",
    "message",
]

_allowed = threading.local()


class LaunchInsideRank(RuntimeError):
    """A launcher that starts ranks of its own was called inside one of nbdist's ranks."""


class CellFunctionInChild(RuntimeError):
    """A "spawn"/"forkserver" child was asked to run a function defined in a cell."""


@contextlib.contextmanager
def allow_launchers():
    """Let the refused launchers start processes in this block (this thread only).

    For helper processes that do not join a process group; a launcher's children
    are not ranks of nbdist's group, and ``%dist_stop`` ends them with their rank.
    """
    depth = getattr(_allowed, "depth", 0)
    _allowed.depth = depth + 1
    try:
        yield
    finally:
        _allowed.depth = depth


def _identity() -> tuple[str, str]:
    return os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")


def _caller_package() -> str | None:
    """'lightning' or 'accelerate' when one of them called the launcher, else None."""
    here = inspect.currentframe()
    frame = here.f_back.f_back if here is not None and here.f_back is not None else None
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        root = name.partition(".")[0]
        if root in ("lightning", "pytorch_lightning", "lightning_fabric"):
            return "lightning"
        if root == "accelerate":
            return "accelerate"
        frame = frame.f_back
    return None


def message(launcher: str, nprocs: object, *, caller: str | None = None, start_method=None) -> str:
    """The error text for ``launcher`` asked to start ``nprocs`` processes on this rank."""
    rank, world = _identity()
    local = os.environ.get("LOCAL_WORLD_SIZE", world)
    how = f" (start_method={start_method!r})" if start_method else ""
    if caller == "lightning":
        through = f"{launcher}, start_method={start_method!r}" if start_method else launcher
        launcher = (
            f"Lightning's strategy 'ddp_notebook', 'ddp_fork' or 'ddp_spawn' (through {through})"
        )
    else:
        launcher += how
    head = (
        f"{launcher} would start {nprocs} processes of its own inside nbdist's rank "
        f"{rank} of {world}. The ranks already are the processes it would start, and the "
        f"process group is formed (torchrun's environment is set: RANK, WORLD_SIZE, ...)."
    )
    if caller == "lightning":
        fix = (
            f"Use strategy='ddp': Trainer(strategy='ddp', devices={local}, accelerator='cpu') "
            "trains on the ranks as they are, in nbdist's group (devices: the ranks on this "
            "host, LOCAL_WORLD_SIZE). On CPU or GPU ranks alike: Trainer(strategy='ddp', "
            "**nbdist.integrations.lightning_trainer_kwargs())."
        )
    elif caller == "accelerate":
        fix = (
            "Do not use accelerate's notebook_launcher inside the ranks: call the training "
            "function directly in a %%on_all_ranks cell, train(*args); Accelerator() on each "
            "rank finds nbdist's group."
        )
    else:
        fix = (
            "Call the worker directly on every rank: worker(rank, *args) instead of "
            "mp.spawn(worker, args=args, nprocs=world_size) (rank is in each rank's "
            "namespace; nbdist.rank() elsewhere). For helper processes that join no "
            "process group: with nbdist.engine.launcher_refusal.allow_launchers(): ..."
        )
    return f"{head}\n{fix}"


def _refusing(fn, launcher: str, nprocs_of, caller: str | None = None):
    if getattr(fn, "nbdist_original", None) is not None:
        return fn

    @functools.wraps(fn)
    def refuse(*args, **kwargs):
        if getattr(_allowed, "depth", 0):
            return fn(*args, **kwargs)
        nprocs, start_method = nprocs_of(*args, **kwargs)
        who = caller or _caller_package()
        raise LaunchInsideRank(message(launcher, nprocs, caller=who, start_method=start_method))

    refuse.nbdist_original = fn
    return refuse


def _spawn_args(fn=None, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    return nprocs, None


def _start_args(fn=None, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
    return nprocs, start_method


def _agent_args(config=None, *rest, **kwargs):
    return getattr(config, "nproc_per_node", "N"), None


def _from_cell(fn) -> bool:
    """Defined in an interactive ``__main__`` (a cell), which a fresh child cannot import."""
    if getattr(fn, "__module__", None) != "__main__":
        return False
    main = sys.modules.get("__main__")
    # A script's __main__ (runpy, %dist_run) has a file the child runs again; a cell's has not.
    return getattr(main, "__file__", None) is None and getattr(main, "__spec__", None) is None


def _check_children(cls, start_method: str) -> None:
    popen = cls._Popen  # the function under the staticmethod
    if getattr(popen, "nbdist_original", None) is not None:
        return

    def check(process_obj):
        candidates = [getattr(process_obj, "_target", None), *getattr(process_obj, "_args", ())]
        for fn in candidates:
            if callable(fn) and _from_cell(fn):
                name = getattr(fn, "__qualname__", repr(fn))
                raise CellFunctionInChild(
                    f"multiprocessing (start method {start_method!r}) cannot run {name} in a "
                    f"child process: {name} was defined in a cell, and a {start_method!r} child "
                    f"imports __main__ afresh, where cells' definitions do not exist (it would die "
                    f"with \"Can't get attribute {name!r} on <module '__main__'>\").\n"
                    f"Use the 'fork' start method, multiprocessing.get_context('fork'), whose "
                    f"children inherit the cell's definitions; or define {name} in a .py file "
                    f"and import it. To run it once per rank, call it directly: the ranks "
                    f"already are separate processes."
                )
        return popen(process_obj)

    check.nbdist_original = popen
    cls._Popen = staticmethod(check)


def _refuse_notebook_launcher(module) -> None:
    """Refuse accelerate's notebook_launcher before its own checks (whose advice is to
    restart the notebook and create no Accelerator, wrong on a rank)."""
    for name in ("notebook_launcher", "debug_launcher"):
        fn = getattr(module, name, None)
        if fn is None or getattr(fn, "nbdist_original", None) is not None:
            continue

        def nprocs_of(function=None, args=(), num_processes=None, *rest, **kwargs):
            return num_processes or "N", None

        setattr(module, name, _refusing(fn, f"accelerate's {name}", nprocs_of, "accelerate"))


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then ``hook(module)``; anything else goes to the original."""

    def __init__(self, loader, hook) -> None:
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.hook(module)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after ``name`` is first imported (before any
    ``from name import ...`` binds its names)."""

    def __init__(self, name: str, hook) -> None:
        self.name, self.hook = name, hook

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader, self.hook)
                return spec
        return None


def install() -> None:
    """Put the refusals in place on this rank (idempotent)."""
    from multiprocessing import context

    import torch.distributed.launcher.api as launcher_api
    import torch.multiprocessing as tmp

    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    start = _refusing(
        spawn_module.start_processes, "torch.multiprocessing.start_processes", _start_args
    )
    spawn = _refusing(spawn_module.spawn, "torch.multiprocessing.spawn (mp.spawn)", _spawn_args)
    # spawn() looks start_processes up in its module; Lightning and accelerate use the
    # package's names: replace both.
    spawn_module.start_processes = tmp.start_processes = start
    spawn_module.spawn = tmp.spawn = spawn
    for cls, method in ((context.SpawnProcess, "spawn"), (context.ForkServerProcess, "forkserver")):
        _check_children(cls, method)
    if "accelerate.launchers" in sys.modules:
        _refuse_notebook_launcher(sys.modules["accelerate.launchers"])
        if "accelerate" in sys.modules:
            _refuse_notebook_launcher(sys.modules["accelerate"])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("accelerate.launchers", _refuse_notebook_launcher))
    launcher_api.launch_agent = _refusing(
        launcher_api.launch_agent,
        "torch's elastic agent (torchrun, accelerate's notebook_launcher)",
        _agent_args,
    )
