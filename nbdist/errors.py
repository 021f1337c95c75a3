"""Both sides: the exceptions nbdist raises, and the wording of rank sets they share.

:class:`RankError` reports what failed on the ranks: every rank's failure,
with identical failures (same error, same traceback up to rank-specific noise)
shown once for the group of ranks that hit them, and failures that differ only
in their numbers (a rank number, a batch size, free memory) shown once with each
number's range across the ranks: at 256 ranks an error whose message names the
rank is one entry, not 8 tracebacks and 248 lines.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nbdist.number_ranges import fold_texts, number_shape

__all__ = [
    "FULL_HINT",
    "ClusterNotRunning",
    "NbdistError",
    "PlacementError",
    "RankError",
    "RanksInterrupted",
    "RankFailure",
    "UnpicklableValue",
    "format_ranks",
    "ranks_text",
    "suspended_words",
]

# Beyond this many distinct failures, further groups get one line each: a
# wall of near-identical tracebacks hides the first one, which matters most.
_MAX_FULL_GROUPS = 8

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")

# Text that differs between ranks even when they failed the same way. Each
# pattern is replaced before tracebacks are compared.
_RANK_NOISE = (
    # "[Engine 3]", "engine 3", "[rank 3]", "rank=3"
    (re.compile(r"\b(engine|rank)(\s*[:#=]?\s*)\d+", re.IGNORECASE), r"\1\2#"),
    # ipyparallel's "[3:execute]" engine prefix
    (re.compile(r"\[\d+:(\w+)\]"), r"[#:\1]"),
    # the per-process directory ipykernel compiles cells into
    (re.compile(r"ipykernel_\d+"), "ipykernel_#"),
    # "Cell In[12], line 3": execution counts drift when an engine restarts
    (re.compile(r"\b(Cell|Input) In ?\[\d+\]"), r"\1 In[#]"),
    # object addresses in reprs differ per process
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "0x#"),
    # a peer's address and port in gloo's errors ("Connection closed by peer
    # [127.0.0.1]:10629"): released ranks name different peers, so the 3 ranks one release
    # ended at 4 ranks read as 2-3 lines (and could read as up to 255 at 256 ranks)
    (
        re.compile(r"\[(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*(?:%[\w.-]+)?)\]:\d+"),
        "[#]:#",
    ),
)


def format_ranks(ranks: Iterable[int]) -> str:
    """Describe a set of ranks compactly: ``[0, 2, 3, 5]`` -> ``"ranks 0,2-3,5"``.

    Ranks are sorted and deduplicated; a single rank reads ``"rank 2"``.
    """
    unique = sorted(set(ranks))
    if not unique:
        raise ValueError("format_ranks needs at least one rank")
    runs: list[tuple[int, int]] = []
    start = prev = unique[0]
    for rank in unique[1:]:
        if rank != prev + 1:
            runs.append((start, prev))
            start = rank
        prev = rank
    runs.append((start, prev))
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(unique) == 1 else f"ranks {text}"


def ranks_text(ranks: Iterable[int]) -> str:
    """'rank 1', 'ranks 1, 2 and 5' for a few; runs for more ('ranks 0-62,64-255').

    A fault message can name hundreds of ranks: a list of each would bury it.
    """
    unique = sorted(set(ranks))
    if 1 < len(unique) <= 3:
        return f"ranks {', '.join(map(str, unique[:-1]))} and {unique[-1]}"
    return format_ranks(unique)


# Shown under a short error: nbdist's own frames are hidden, not lost.
FULL_HINT = "(%dist_last_error --full shows the whole traceback)"


class NbdistError(Exception):
    """Base class of nbdist's exceptions."""

    def _render_traceback_(self) -> list[str]:
        """For IPython: what happened and what to do, first; nbdist's own frames left out.

        The frames of nbdist's magics and waits say nothing a user can act on and
        used to push the message 30 lines down; ``%dist_last_error --full`` prints them.
        """
        return [f"{type(self).__name__}: {self}", FULL_HINT]


class ClusterNotRunning(NbdistError):
    """An operation needs the cluster, and none is running."""

    default_message = (
        "no nbdist cluster is running: start one with %dist_start (or DistSession().start())"
    )

    def __init__(self, message: str | None = None) -> None:
        """The error with ``message``, or the default that says how to start a cluster."""
        super().__init__(message or self.default_message)


class PlacementError(NbdistError, ValueError):
    """A requested placement of ranks on devices is invalid."""


class UnpicklableValue(NbdistError):
    """A value a rank sent (a pulled name, a function's result) the kernel cannot unpickle.

    Its class exists only on the ranks: defined in a cell that ran there, or in a
    module only they can import. ``cause``: the unpickling error, as
    ``"AttributeError: Can't get attribute 'Thing' on <module '__main__'>"``;
    ``message``: the whole explanation (by default, for one rank's value).
    """

    fix = (
        "define the class in a module both the kernel and the ranks import, or {send} plain "
        "data: str(x), a dict of numbers, a tensor"
    )
    _PREFIX = "the kernel cannot unpickle the value this rank sent ("

    def __init__(self, cause: str, message: str = "") -> None:
        """The error for ``cause``; ``message`` replaces the default explanation."""
        super().__init__(cause, message)  # both: the exception stays picklable
        self.cause = cause
        self.message = message or f"{self._PREFIX}{cause}): " + self.fix.format(send="send")

    def __str__(self) -> str:
        """What the kernel could not unpickle, and what to do."""
        return self.message

    @classmethod
    def cause_in(cls, text: str) -> str:
        """The cause in a default message (as a :class:`RankFailure` keeps it), else ``text``."""
        suffix = "): " + cls.fix.format(send="send")
        if text.startswith(cls._PREFIX) and text.endswith(suffix):
            return text[len(cls._PREFIX) : -len(suffix)]
        return text


@dataclass(frozen=True)
class RankFailure:
    """How one rank failed: the remote exception and its traceback text."""

    rank: int
    ename: str
    evalue: str
    traceback: str  # as rendered remotely; may contain ANSI colour codes


def _normalised_traceback(text: str) -> str:
    text = _ANSI_ESCAPE.sub("", text)
    for pattern, replacement in _RANK_NOISE:
        text = pattern.sub(replacement, text)
    return text


def _failure_key(failure: RankFailure) -> tuple[str, str, str]:
    return (failure.ename, failure.evalue, _normalised_traceback(failure.traceback))


# torch's collective check prints each call's options whole, "TensorOptions(dtype=float
# (default), device=cpu, layout=Strided (default), ..., memory_format=(nullopt))", twice a
# message: three quarters of a 700-character line. The headline keeps what is set.
_TENSOR_OPTIONS = re.compile(r"TensorOptions\(((?:[^()]|\([^()]*\))*)\)")


def _set_options_only(match: re.Match) -> str:
    kept = [
        item
        for item in match.group(1).split(", ")
        if not item.endswith(" (default)") and not item.endswith("=(nullopt)")
    ]
    return f"TensorOptions({', '.join(kept)})"


def _headline(failure: RankFailure) -> str:
    """The failure in one line; the traceback below it and ``--full`` keep the text whole."""
    if not failure.evalue:
        return failure.ename
    return f"{failure.ename}: {_TENSOR_OPTIONS.sub(_set_options_only, failure.evalue)}"


def _family_key(failure: RankFailure) -> tuple[str, str, str]:
    """What failures that differ only in their message's numbers share.

    The traceback is compared whole but for the message it repeats, so the same
    message raised at another line, or with other frames, stays apart.
    """
    trace = _normalised_traceback(failure.traceback)
    if failure.evalue:
        trace = trace.replace(_normalised_traceback(failure.evalue), "\0message\0")
    return (failure.ename, number_shape(failure.evalue), trace)


_UNDEFINED = re.compile(r"name '([^']+)' is not defined")


class RankError(NbdistError):
    """One or more ranks raised; carries every rank's failure, grouped.

    ``world_ranks`` (all ranks that ran) lets the summary say "2 of 4 ranks
    failed"; ``note`` is an extra line for context (e.g. which ranks were
    still running).
    """

    def __init__(
        self,
        failures: Sequence[RankFailure],
        *,
        world_ranks: Sequence[int] | None = None,
        note: str = "",
    ) -> None:
        """The ranks' ``failures``; ``world_ranks``: every rank that ran; ``note``: a line more."""
        ordered = tuple(sorted(failures, key=lambda failure: failure.rank))
        if not ordered:
            raise ValueError("RankError needs at least one RankFailure")
        # Passing the failures as the sole positional argument keeps the
        # exception picklable (Exception reduces to cls(*args) + __dict__).
        super().__init__(ordered)
        self.failures: tuple[RankFailure, ...] = ordered
        self.world_ranks: tuple[int, ...] | None = (
            tuple(sorted(set(world_ranks))) if world_ranks is not None else None
        )
        self.note = note

    @property
    def ranks(self) -> list[int]:
        """The ranks that failed, sorted."""
        return sorted({failure.rank for failure in self.failures})

    def undefined_name(self) -> str | None:
        """The one name every failing rank lacked, when a NameError of it is all that failed.

        A name the user has not defined on the ranks yet is a slip, not a rank's
        error: the magics that evaluate a name or an expression say so in one line.
        """
        found = set()
        for failure in self.failures:
            match = _UNDEFINED.match(failure.evalue) if failure.ename == "NameError" else None
            if match is None:
                return None
            found.add(match.group(1))
        return found.pop() if len(found) == 1 else None

    def groups(self) -> list[tuple[list[int], RankFailure]]:
        """Identical failures grouped as (ranks, representative failure).

        Failures are identical when name, message and traceback match, the
        traceback compared without colours and rank-specific noise (engine ids,
        rank numbers, process ids, addresses). Groups are ordered by their
        lowest rank, which also provides the representative failure.
        """
        groups: dict[tuple[str, str, str], tuple[list[int], RankFailure]] = {}
        for failure in self.failures:
            ranks, _ = groups.setdefault(_failure_key(failure), ([], failure))
            if failure.rank not in ranks:
                ranks.append(failure.rank)
        return list(groups.values())

    def families(self) -> list[list[tuple[list[int], RankFailure]]]:
        """The groups, those that differ only in their message's numbers together.

        ``ValueError: bad batch on rank 3`` and ``... rank 8`` raised by the same
        code are one family; ordered by lowest rank, as the groups within one.
        """
        families: dict[tuple[str, str, str], list[tuple[list[int], RankFailure]]] = {}
        for ranks, failure in self.groups():
            families.setdefault(_family_key(failure), []).append((ranks, failure))
        return list(families.values())

    def __str__(self) -> str:
        """One line per family of failures (a few alike: one per message), then the note."""
        lines = [
            f"{format_ranks(ranks)}: {headline}"
            for family in self.families()
            for ranks, headline in _family_headlines(family)
        ]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        """Render for IPython, in place of the (useless) local traceback."""
        families = self.families()
        lines: list[str] = []
        for family in families[:_MAX_FULL_GROUPS]:
            lines.extend(f"[{format_ranks(r)}] {text}" for r, text in _family_headlines(family))
            first_ranks, failure = family[0]
            if len(family) > 1:
                lines.append(
                    f"(one error, its numbers differing between the ranks; the traceback is "
                    f"{format_ranks(first_ranks[:1])}'s; %dist_last_error --full shows each rank's)"
                )
            lines.extend(failure.traceback.splitlines())
            lines.append("")
        rest = families[_MAX_FULL_GROUPS:]
        if rest:
            noun = "failure" if len(rest) == 1 else "failures"
            lines.append(f"{len(rest)} more distinct {noun} (tracebacks omitted):")
            lines.extend(
                f"[{format_ranks(r)}] {text}"
                for family in rest
                for r, text in _family_headlines(family)
            )
        lines.append(self._summary())
        if self.note:
            lines.append(self.note)
        return lines

    def _summary(self) -> str:
        failed = len(self.ranks)
        if self.world_ranks is not None:
            total = len(self.world_ranks)
            return f"{failed} of {total} {'rank' if total == 1 else 'ranks'} failed"
        return f"{failed} {'rank' if failed == 1 else 'ranks'} failed"


def _family_headlines(
    family: Sequence[tuple[list[int], RankFailure]],
) -> list[tuple[list[int], str]]:
    """(ranks, headline) lines of one family: each message while few, else one with ranges."""
    return fold_texts({rank: _headline(failure) for ranks, failure in family for rank in ranks})


def suspended_words(ranks: Sequence[int], processes: str) -> str:
    """What an interrupt's error says of ``ranks`` whose processes are stopped; ``processes``:
    which they are and what lets them go on (:func:`nbdist.driver.process_state.stopped_in_words`)."""
    return f"{format_ranks(ranks)} cannot take the interrupt until continued: {processes}"


class RanksInterrupted(KeyboardInterrupt):
    """The cell was interrupted (Ctrl-C or a kernel interrupt) and SIGINT relayed to its ranks.

    A KeyboardInterrupt, so ``except KeyboardInterrupt`` still catches it. It
    renders where each rank stopped (their tracebacks, grouped) instead of the
    kernel's own uninteresting wait loop, and names ranks that did not stop.
    """

    def __init__(
        self,
        stopped: RankError | None = None,
        still_running: Sequence[int] = (),
        *,
        where: str = "",
        note: str = "",
        finished: Sequence[int] = (),
        caught: Sequence[int] = (),
        suspended: Sequence[int] = (),
        suspended_words: str = "",
    ):
        """``stopped``: the ranks' errors once stopped; ``still_running``: ranks that did not
        stop; ``finished``: ranks that ran the cell to its end all the same; ``caught``: ranks
        whose code caught the KeyboardInterrupt and handled it (some may still be running);
        ``suspended``: ranks still running whose processes are stopped (SIGSTOP, a tracer),
        which take no signal until continued, and ``suspended_words`` says so."""
        super().__init__(stopped, tuple(still_running))
        self.stopped = stopped
        self.still_running = tuple(still_running)
        self.finished = tuple(finished)
        self.caught = tuple(caught)
        self.suspended = tuple(suspended)
        self.suspended_words = suspended_words
        self.where = where  # the ranks' stacks when a rank was waiting in a collective
        self.note = note  # which ranks were released from a collective, and the group's fate

    def __str__(self) -> str:
        """What happened to the ranks after the interrupt, in one line."""
        if self.still_running:
            parts = []
            held = [r for r in self.still_running if r in self.suspended]
            if held:
                # Interrupting again cannot reach them: the signal waits until they go on.
                parts.append(suspended_words(held, self.suspended_words))
            stuck = [r for r in self.still_running if r not in self.caught and r not in held]
            if stuck:
                parts.append(
                    f"{format_ranks(stuck)} did not stop after the interrupt (blocked in a "
                    "collective or in native code?)"
                )
            if self.caught:
                runs = "runs its" if len(self.caught) == 1 else "run their"
                parts.append(
                    f"{format_ranks(self.caught)} caught the KeyboardInterrupt and still "
                    f"{runs} handling code (the next cell runs there after it)"
                )
            if len(held) == len(self.still_running):
                return "; ".join(parts) + "; or %dist_restart"
            return "; ".join(parts) + "; interrupt again, or %dist_restart"
        handled = ""
        if self.caught:
            own = "its own code" if len(self.caught) == 1 else "their own code"
            handled = (
                f" ({format_ranks(self.caught)} first ran {own} that caught the KeyboardInterrupt)"
            )
        if self.finished:
            # Said plainly: their cell's work was all done (the interrupt came too late there).
            if self.stopped is None and not self.caught:
                return "interrupted, but every rank had run the cell to its end"
            return (
                f"interrupted; {format_ranks(self.finished)} ran the cell to its end all the "
                f"same{handled}"
            )
        return f"interrupted; every rank stopped{handled}"

    def _render_traceback_(self) -> list[str]:
        if self.stopped is None and self.finished and not (self.still_running or self.caught):
            # No rank stopped: "interrupted on every rank" would say the opposite of the end.
            lines = ["KeyboardInterrupt: the cell was interrupted too late on every rank"]
        else:
            lines = ["KeyboardInterrupt: the cell was interrupted on every rank"]
        if self.stopped is not None:
            lines += ["", *self.stopped._render_traceback_()[:-1]]
        if self.where:
            lines += ["", "where the ranks were when interrupted:", *self.where.splitlines()]
        if self.note:
            lines.append(self.note)
        if self.still_running or self.finished or self.caught:
            lines.append(str(self))
        return lines
