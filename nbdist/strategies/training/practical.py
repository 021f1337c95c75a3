"""Rank side: everyday multi-rank chores: a one-time data preparation step, rank-0-only work.

:func:`nbdist.rank_zero_first` orders the ranks; :func:`prepare_once` adds the
rest of the usual pattern around it: rank 0 builds a file (a tokenised data
set, a download, a cache) only if it does not exist, writing it atomically so
no rank ever reads half a file, and every rank then loads it.
:func:`rank_zero_only` turns a function (a checkpoint save, a report) into one
that runs on rank 0 and returns ``None`` elsewhere.

Example (on every rank)::

    from nbdist.strategies.training.practical import prepare_once
    data = prepare_once("/tmp/digits.pt", lambda: torch.randn(1000, 64))
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbdist.engine.helpers import rank, rank_zero_first

__all__ = ["prepare_once", "rank_zero_only"]


def _torch_save(obj: Any, path: Path) -> None:
    import torch

    torch.save(obj, path)


def _torch_load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)


def prepare_once(
    path: str | os.PathLike,
    build: Callable[[], Any],
    *,
    save: Callable[[Any, Path], None] = _torch_save,
    load: Callable[[Path], Any] = _torch_load,
) -> Any:
    """Rank 0 runs ``build()`` and saves it to ``path`` unless it exists; every rank loads it.

    Every rank must call it (it holds two barriers). The file is written to a
    temporary name and renamed, so a crash leaves no partial file behind and a
    later run rebuilds it. ``path`` must be visible to every rank (a local path
    on one machine, a shared file system across machines).

    Example::

        tokens = prepare_once("cache/tokens.pt", tokenize_corpus)
    """
    if not callable(build) or not callable(save) or not callable(load):
        # Checked on every rank, before the barriers: rank 0 alone would fail in build().
        raise TypeError(
            f"prepare_once: build, save and load must be functions, got build={build!r}: pass "
            "the function itself, e.g. prepare_once(path, tokenize_corpus), not its result"
        )
    target = Path(path).expanduser()  # "~/cache" is the home directory, as in a shell
    with rank_zero_first():
        if rank() == 0 and not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            try:
                save(build(), partial)
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
        if not target.exists():
            raise FileNotFoundError(
                f"{target} does not exist after rank 0 prepared it: rank 0's build() or save() "
                "raised (see its error), or the path is on no file system every rank sees "
                "(use a shared directory across machines)"
            )
        return load(target)


def rank_zero_only(fn: Callable) -> Callable:
    """Decorate ``fn`` so it runs on rank 0 only (``None`` elsewhere); no synchronisation.

    Example::

        @rank_zero_only
        def save_checkpoint(model, path):
            torch.save(model.state_dict(), path)
    """

    if not callable(fn):
        raise TypeError(
            f"rank_zero_only decorates a function, got {type(fn).__name__}: write "
            "@rank_zero_only above a def, or rank_zero_only(fn)(args)"
        )

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapper
