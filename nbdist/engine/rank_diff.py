"""Rank side: the calls ``%dist_diff`` makes on each rank, on the value it evaluated there.

The kernel (:mod:`nbdist.driver.diff`) runs ``held[token] = (EXPR)`` on the
ranks as a cell (so EXPR fails like any cell), then applies these functions
with the token, and :func:`forget` at the end. Each reads the value held
under the token and hands it to :mod:`nbdist.engine.fingerprint`'s function of
the same purpose. They import torch (through
:mod:`nbdist.engine.fingerprint`) only when they run, so the kernel can name
them without importing torch.
"""

from __future__ import annotations

__all__ = ["compare_held", "forget", "held", "held_fingerprints", "held_reference_data"]

# The kernel's cell stores each evaluated expression here, under a fresh token.
held: dict[str, object] = {}


def forget(token: str) -> None:
    """Forget the value held under ``token`` (a no-op if there is none)."""
    held.pop(token, None)


def held_fingerprints(token: str) -> list:
    """(path, record) for every node of the value held under ``token``."""
    from nbdist.engine import fingerprint

    return fingerprint.fingerprints(held[token])


def held_reference_data(token: str, paths) -> dict:
    """The held value's leaves at ``paths``, as the reference rank sends them to the others."""
    from nbdist.engine import fingerprint

    return fingerprint.reference_data(held[token], paths)


def compare_held(token: str, reference: dict, wanted: dict) -> dict:
    """This rank's leaves at ``wanted[rank]`` compared with the reference rank's ``reference``."""
    from nbdist.engine import fingerprint
    from nbdist.engine.helpers import rank

    return fingerprint.compare_with(held[token], reference, wanted.get(rank(), []))
