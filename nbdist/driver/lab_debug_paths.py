"""Kernel side: the paths JupyterLab's debugger and a rank use for one file, when they differ.

A rank on a machine that holds a copy of a synced path (``%dist_sync``) imports
the file from its copy: debugpy there knows it by the copy's path, JupyterLab by
the path on the notebook's machine. :class:`RankPaths` keeps, per rank, which
synced paths it runs from a copy, and translates the two directions the router
needs: a breakpoint's source path on its way to the rank, a frame's source path
on its way back.
"""

from __future__ import annotations

import os

__all__ = ["RankPaths"]


def _moved(path: str, pairs: dict[str, str]) -> str:
    # ``path`` under one of ``pairs``' keys, carried under the matching value.
    for old, new in pairs.items():
        if path == old or path.startswith(old.rstrip(os.sep) + os.sep):
            return new + path[len(old) :]
    return path


class RankPaths:
    """Per rank: ``{path on the notebook's machine: the copy's path there}``."""

    def __init__(self) -> None:
        """No rank runs a copy yet."""
        self._copies: dict[int, dict[str, str]] = {}

    def update(self, copies: dict[int, dict[str, str]]) -> list[int]:
        """Take ``copies`` (:func:`nbdist.driver.file_sync.copies_by_rank`); the ranks whose changed."""
        changed = [
            r for r in set(copies) | set(self._copies) if copies.get(r) != self._copies.get(r)
        ]
        self._copies = {r: dict(c) for r, c in copies.items() if c}
        return sorted(changed)

    def to_rank(self, rank: int, arguments: dict) -> dict:
        """``setBreakpoints`` arguments as ``rank`` knows the file (unchanged where it is in place)."""
        pairs = self._copies.get(rank)
        path = (arguments.get("source") or {}).get("path")
        if not pairs or not path or _moved(path, pairs) == path:
            return arguments
        return dict(arguments, source=dict(arguments["source"], path=_moved(path, pairs)))

    def from_rank(self, rank: int, frame: dict) -> dict:
        """A stack frame of ``rank`` with its source path as the notebook's machine has it."""
        pairs = self._copies.get(rank)
        path = (frame.get("source") or {}).get("path")
        if not pairs or not path:
            return frame
        back = _moved(path, {copy: origin for origin, copy in pairs.items()})
        return frame if back == path else dict(frame, source=dict(frame["source"], path=back))
