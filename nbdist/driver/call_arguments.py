"""Kernel side: what ``DistSession.run``, ``push`` and ``pull`` are given, checked before any rank sees it.

A value of the wrong kind would otherwise fail on every rank with an error of
its own (``s.run(b"x = 1")`` runs base64 text there, ``push({"1a": 1})`` is a
SyntaxError on each rank) or not at all (``s.run(None)`` waited for ever). Each
refusal names the value and what to give instead. A cell that awaits at its top
level is refused too: an engine's kernel fails it without a reply (ipykernel 7's
path for such cells reads a thread ipyparallel's engine does not have), so the
cell would wait for ever.
"""

from __future__ import annotations

import ast
import inspect
import keyword
from collections.abc import Mapping

from nbdist.errors import PlacementError
from nbdist.launch.values import as_index, check_seconds

__all__ = ["check_code", "check_cell_timeout", "check_names", "check_one_rank"]


def check_code(code) -> str:
    """``code`` if it is Python source text; TypeError otherwise."""
    if not isinstance(code, str):
        shown = repr(code)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise TypeError(
            f"run(): code must be a str of Python source, got {shown} (a {type(code).__name__})"
            + (": decode it first, code.decode()" if isinstance(code, bytes) else "")
        )
    _refuse_top_level_await(code)
    return code


def _refuse_top_level_await(code: str) -> None:
    """ValueError if the cell awaits at its top level (``await``, ``async for``/``with``
    outside an ``async def``); a cell that does not compile is left to the ranks' error."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        source = TransformerManager().transform_cell(code)  # %magics and !commands
        compiled = compile(source, "<cell>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except (SyntaxError, ValueError, ImportError):
        return
    if not compiled.co_flags & inspect.CO_COROUTINE:
        return
    line = _first_await_line(source)
    raise ValueError(
        f"this cell awaits at its top level{line}, which the ranks cannot run: their engine's "
        "kernel fails such a cell without replying. Put the awaits in an async function "
        "and run it in a thread of its own (the rank's main thread runs the engine's event "
        "loop, so asyncio.run there refuses): concurrent.futures.ThreadPoolExecutor(1)"
        ".submit(asyncio.run, main()).result()"
    )


def _first_await_line(source: str) -> str:
    """ " (line N)" of the first top-level await in ``source`` (not inside a function)."""

    def visit(node) -> int | None:
        if isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef, ast.Lambda)):
            return None
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)) or (
            isinstance(node, ast.comprehension) and node.is_async
        ):
            return getattr(node, "lineno", None) or getattr(node.iter, "lineno", None)
        for child in ast.iter_child_nodes(node):
            found = visit(child)
            if found is not None:
                return found
        return None

    found = visit(ast.parse(source))
    return f" (line {found})" if found is not None else ""


def check_cell_timeout(timeout) -> float | None:
    """A cell's ``timeout`` as seconds > 0 (None: no limit); refused as the session's own are."""
    if isinstance(timeout, bool):  # True is 1 to float(), not a number of seconds to a user
        raise PlacementError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return None if timeout is None else check_seconds(timeout, "timeout")


def check_names(mapping) -> dict:
    """``mapping`` as a dict of Python names to values, for the ranks' namespaces."""
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"push(): give a dict of names to values, e.g. push({{'lr': 0.1}}), "
            f"got a {type(mapping).__name__}"
        )
    bad = [
        k
        for k in mapping
        if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k))
    ]
    if bad:
        raise PlacementError(
            f"push(): {bad[0]!r} is no Python name: the keys become variables on the ranks "
            "(letters, digits and _, not starting with a digit, no keyword); nothing was pushed"
        )
    return dict(mapping)


def check_one_rank(rank) -> int | None:
    """``pull``'s ``rank``: one rank number (NumPy's integers too), or None for every rank."""
    if rank is None:
        return None
    index = as_index(rank)
    if index is None:
        raise PlacementError(
            f"pull(): rank={rank!r} is not one rank number: give one, e.g. rank=0, or leave "
            "it out for a list of every rank's value"
        )
    return index
