"""Kernel and Jupyter server: the one palette of rank colours, shared by every view of a run.

Rank ``r`` is drawn in ``rank_colours()[r % len(rank_colours())]`` everywhere: the
live dashboard's traces and legend, the comparison chart
(:mod:`nbdist.dashboard.plan_comparison`), and the JupyterLab sidebar and status bar (which
read this list from the server). The colours are plotly's default ten ("category10"),
with the five that are too light on a white page darkened to the same hue, so that
every line stands out at least 3:1 (the WCAG contrast for graphics) on a light
page and on JupyterLab's dark theme alike.

Example::

    >>> from nbdist.dashboard.palette import rank_colour, rank_colours
    >>> rank_colours()[:2]
    ['#1f77b4', '#e76c00']
    >>> rank_colour(11) == rank_colours()[1]
    True
"""

from __future__ import annotations

__all__ = ["RANK_COLOURS", "contrast", "rank_colour", "rank_colours"]

RANK_COLOURS = (
    "#1f77b4",
    "#e76c00",  # category10's #ff7f0e, darkened (2.5:1 on white)
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#9d6054",  # #8c564b, lightened (too dark on the dark theme)
    "#df62b9",  # #e377c2, darkened
    "#7f7f7f",
    "#93941b",  # #bcbd22, darkened
    "#139ead",  # #17becf, darkened
)


def rank_colours() -> list[str]:
    """The rank colours in order (``#rrggbb``): rank ``r`` takes entry ``r % len(list)``."""
    return list(RANK_COLOURS)


def rank_colour(rank: int) -> str:
    """Rank ``rank``'s colour (``#rrggbb``); the palette repeats after ten ranks."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def contrast(a: str, b: str) -> float:
    """The WCAG contrast ratio of two ``#rrggbb`` colours, 1 (same) to 21 (black on white)."""

    def luminance(colour: str) -> float:
        if len(colour) != 7 or colour[0] != "#":
            raise ValueError(f"colour must be '#rrggbb', got {colour!r}")
        channels = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)
