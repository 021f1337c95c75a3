"""Kernel side: the paths JupyterLab's debugger and a rank use for one file, when they differ.

A rank on a machine that holds a copy of a synced path (``%dist_sync``) imports
the file from its copy: debugpy there knows it by the copy's path, JupyterLab by
the path on the notebook's machine. :class:`RankPaths` keeps, per rank, which
synced paths it runs from a copy (as the rank itself reports them, so a kernel
that attached to a named session knows them too), and translates the two
directions the router needs: a breakpoint on its way to the rank goes to both
paths (the copy may lack the file: one left out, one next to a single synced
file), a frame's source path on its way back names the notebook's file.
"""

from __future__ import annotations

import os

__all__ = ["RankPaths"]


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _moved(path: str, pairs: dict[str, str]) -> str:
    # ``path`` under one of ``pairs``' keys (the longest that holds it), under its value.
    for old in sorted(pairs, key=len, reverse=True):
        if _under(path, old):
            return pairs[old] + path[len(old) :]
    return path


class RankPaths:
    """Per rank: ``{path on the notebook's machine: the copy's path there}``."""

    def __init__(self) -> None:
        """No rank runs a copy yet."""
        self._copies: dict[int, dict[str, str]] = {}

    def update(self, copies: dict[int, dict[str, str]]) -> list[int]:
        """Take the copies of the ranks in ``copies``, as they reported them.

        Returns the ranks whose copies changed.
        """
        changed = sorted(r for r, c in copies.items() if (c or None) != self._copies.get(r))
        for rank, pairs in copies.items():
            if pairs:
                self._copies[rank] = dict(pairs)
            else:
                self._copies.pop(rank, None)
        return changed

    def to_rank(self, rank: int, arguments: dict) -> list[dict]:
        """``setBreakpoints`` arguments for ``rank``: as given, and at each of its copies' paths.

        An empty list of breakpoints goes to both alike, so a removal reaches both.
        """
        pairs = self._copies.get(rank) or {}
        path = (arguments.get("source") or {}).get("path") or ""
        # Each synced path that holds the file (nested ones: /a and /a/src) has its copy.
        moved = [pairs[o] + path[len(o) :] for o in sorted(pairs) if path and _under(path, o)]
        return [arguments] + [
            dict(arguments, source=dict(arguments["source"], path=m)) for m in moved
        ]

    def from_rank(self, rank: int, frame: dict) -> dict:
        """A stack frame of ``rank`` with its source path as the notebook's machine has it."""
        pairs = self._copies.get(rank)
        path = (frame.get("source") or {}).get("path")
        if not pairs or not path:
            return frame
        back = _moved(path, {copy: origin for origin, copy in pairs.items()})
        return frame if back == path else dict(frame, source=dict(frame["source"], path=back))
