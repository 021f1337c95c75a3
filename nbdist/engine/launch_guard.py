"""Rank side: launchers that would start processes of their own inside a rank.

(Filled in with the guards; :func:`install` is called once per rank when it joins.)
"""

from __future__ import annotations

__all__ = ["install"]


def install() -> None:
    """Put the guards in place on this rank (idempotent)."""
