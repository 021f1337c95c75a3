"""Kernel side, before anything starts: the checks of single option values.

Shared by :mod:`nbdist.launch.options` (a whole start), :mod:`nbdist.launch.launcher_options`
(Slurm, SSH and MPI options) and :mod:`nbdist.launch.placement`, so that a value is
refused with the same words wherever it comes in. The ``parse_*`` functions turn
a magic's words into values; the ``check_*`` functions refuse bad values
(:class:`~nbdist.errors.PlacementError`, naming the value and the fix).

Example::

    >>> parse_count("4", "number of ranks", "4")
    4
    >>> is_digits("²")
    False
"""

from __future__ import annotations

import math
import operator
import re

from nbdist.errors import PlacementError

__all__ = [
    "as_index",
    "check_count",
    "check_seconds",
    "check_threads",
    "is_digits",
    "is_whole",
    "parse_count",
    "parse_duration",
    "parse_seconds",
]

_NUMBER = re.compile(r"^[0-9]+$")
_DURATION = re.compile(r"^([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def is_whole(value) -> bool:
    """An int that is not a bool (``True`` is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_index(value) -> int | None:
    """``value`` as an int if it is a whole number a list index takes (NumPy's too), else None.

    Bools are none: ``True`` is an int to Python, not a rank to a user.
    """
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", type(value).__name__)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def is_digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit()`` also accepts '²' and '٣', which ``int()`` may refuse."""
    return bool(_NUMBER.match(text))


def check_count(n, what: str = "number of ranks") -> None:
    """Refuse anything but a whole number >= 1 (None passes: "the default")."""
    if n is not None and (not is_whole(n) or n < 1):
        raise PlacementError(f"{what} must be a whole number >= 1, got {n!r}")


def check_threads(threads) -> None:
    """Refuse a thread count that is not a whole number >= 1 (None passes)."""
    if threads is not None and (not is_whole(threads) or threads < 1):
        raise PlacementError(f"--threads must be a whole number >= 1, got {threads!r}")


def check_seconds(value, flag: str) -> float:
    """``value`` as a float > 0 and finite, or refused naming ``flag``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):  # also NaN
        raise PlacementError(f"{flag} must be a positive number of seconds, got {value!r}")
    return seconds


def parse_count(text: str, what: str, example: str) -> int:
    """A magic's word for a count ('4') as an int; ``what`` and ``example`` word the refusal."""
    if not is_digits(text) or int(text) < 1:
        raise PlacementError(f"{what} {text!r}: give a whole number >= 1, e.g. {example}")
    return int(text)


def parse_seconds(text: str, flag: str = "--timeout") -> float:
    """A magic's word for seconds ('60', '0.5') as a float > 0, finite."""
    try:
        value = float(text)
    except ValueError:
        raise PlacementError(
            f"{flag} {text!r} is not a number of seconds, e.g. {flag} 60"
        ) from None
    if not value > 0 or value == float("inf"):  # also NaN
        raise PlacementError(f"{flag} {text!r} must be more than 0 seconds (and finite)")
    return value


def parse_duration(text: str, flag: str) -> float:
    """A duration as a user writes it ('90', '90s', '30m', '2h', '1.5d') in seconds, > 0.

    >>> parse_duration("30m", "--idle-timeout")
    1800.0
    """
    match = _DURATION.match(str(text).strip().lower())
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if match and not 0 < seconds < math.inf:
        raise PlacementError(f"{flag} {text!r} must be more than 0 seconds (and finite)")
    if not match:
        raise PlacementError(
            f"{flag} {text!r} is not a duration: a number of seconds, or with a unit "
            f"s, m, h or d, e.g. {flag} 30m"
        )
    return seconds
