"""Kernel side: the dashboard as plain text, for terminals, scripts and notebooks viewed without widgets.

Example::

    >>> print(summary_text(run))                                        # doctest: +SKIP
    run 3 · 4 ranks · gloo · 4,000 points
    rank  step    loss  samples/s  step time   memory  last seen  state
       0   999  0.1031      6,400   100.0 ms  512 MiB  0.3 s ago  busy
       ...
    series          last      mean       min       max
    loss          0.1024    0.3421   0.09876     2.301

Above ``PER_RANK_UP_TO`` ranks the per-rank table gives way to a line of counts
(ranks by state, the step range, the total throughput, the straggler named),
one row per host, and the rows of the ranks that deviate: dead, stragglers,
ranks in a state few share (busy while the others are idle), a loss gone NaN or
infinite, no points while the others log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from nbdist.dashboard.breakdown import PARTS, breakdown, shares
from nbdist.dashboard.losses import loss_lines
from nbdist.dashboard.notes import note_lines
from nbdist.dashboard.table import (
    PER_RANK_UP_TO,
    deviating_rows,
    fmt_rate,
    fmt_value,
    has_flops,
    has_gpu,
    headers,
    plural,
    rank_rows,
    state_counts,
    throughput_key,
)
from nbdist.errors import format_ranks
from nbdist.rank_states import BUSY, DEAD, IDLE
from nbdist.text_table import format_table

__all__ = ["summary_text"]


def summary_text(
    run,
    states: Mapping[int, str] | Callable[[], Mapping[int, str]] | None = None,
    *,
    now: float | None = None,
) -> str:
    """A fixed-width table per rank, then one line per series: last / mean / min / max.

    ``last`` is the mean over ranks of each rank's latest value, as logged: NaN (or
    inf) when one is, so a diverged rank shows there, and a line under the table says
    on how many ranks; mean, min and max are over every point of every rank (NaN and
    inf left out).
    ``states``: {rank: state} or a callable returning it (``"dead"`` is shown).
    """
    now = time.time() if now is None else now
    keys = run.keys()
    lines = [_title(run)]
    rows = rank_rows(run, states, now=now)
    header = headers(keys)
    shown = rows
    if len(rows) > PER_RANK_UP_TO:
        lines += _grouped(rows, throughput_key(keys))
        shown = deviating_rows(rows)
    cells = [row.cells(now, gpu=has_gpu(keys), flops=has_flops(keys)) for row in shown]
    # Numbers align right; the state and the straggler flag (the last two columns), left.
    if cells:
        lines.append(format_table(header, cells, right=range(len(header) - 2)))
    if "comm_s" in keys:
        lines += _breakdown_lines(run, rows)
    lines += loss_lines(run) + note_lines(run)
    if keys:
        stats = {key: _stats(run, key) for key in keys if key != "gpu_index"}  # a GPU's number
        series = [[key, *(fmt_value(v) for v in figures[:4])] for key, figures in stats.items()]
        lines.append("")
        lines.append(
            format_table(["series", "last", "mean", "min", "max"], series, right={1, 2, 3, 4})
        )
        for key, (*_, broken, of) in stats.items():
            if broken:
                named = ", ".join(str(r) for r in broken[:8]) + (", ..." if len(broken) > 8 else "")
                lines.append(
                    f"{key}: latest value NaN/inf on {len(broken)} of {plural(of, 'rank')} "
                    f"(rank{'s' if len(broken) > 1 else ''} {named}); mean, min and max "
                    "leave NaN/inf out"
                )
    return "\n".join(lines)


def _breakdown_lines(run, rows: list) -> list[str]:
    """The step breakdown: ranks with the same shares (as shown, whole %) on one line.

    Above ``PER_RANK_UP_TO`` ranks, as in the table: the shares most ranks have, once,
    then only the deviating ranks' that differ, and how far the others are from it.
    """
    same: dict[str, list[int]] = {}
    percent: dict[str, list[int]] = {}
    for rank, frac in shares(breakdown(run)).items():
        numbers = whole_percents([frac[key] for key, _ in PARTS])
        parts = " · ".join(f"{name} {n} %" for (_, name), n in zip(PARTS, numbers))
        same.setdefault(parts, []).append(rank)
        percent[parts] = numbers
    if not same:
        return []
    lines = ["step breakdown (latest steps):"]
    if len(rows) <= PER_RANK_UP_TO:
        for parts, ranks in sorted(same.items(), key=lambda item: min(item[1])):
            lines.append(f"  {format_ranks(ranks)}: {parts}")
        return lines
    common = max(same, key=lambda parts: (len(same[parts]), -min(same[parts])))
    lines.append(f"  {format_ranks(same[common])}: {common}")
    odd = {row.rank for row in deviating_rows(rows)}
    rest, furthest = 0, 0
    for parts, ranks in sorted(same.items(), key=lambda item: min(item[1])):
        if parts == common:
            continue
        named = [r for r in ranks if r in odd]
        if named:
            lines.append(f"  {format_ranks(named)}: {parts}")
        if len(named) < len(ranks):
            rest += len(ranks) - len(named)
            gap = max(abs(a - b) for a, b in zip(percent[parts], percent[common]))
            furthest = max(furthest, gap)
    if rest:
        lines.append(
            f"  {plural(rest, 'other rank')} (not deviating): each part within "
            f"{furthest} % of these"
        )
    return lines


def whole_percents(fractions: list[float]) -> list[int]:
    """Shares as whole percents that add up to 100 (largest remainders round up).

    Each rounded alone, thirds read 33 + 33 + 33 = 99 %.

    >>> whole_percents([1 / 3, 1 / 3, 1 / 3]), whole_percents([0.154, 0.423, 0.423])
    ([34, 33, 33], [16, 42, 42])
    """
    total = sum(fractions)
    if not total > 0:
        return [round(100 * f) if f == f else 0 for f in fractions]
    exact = [100 * f / total for f in fractions]
    whole = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: whole[i] - exact[i])[: 100 - sum(whole)]:
        whole[i] += 1
    return whole


def _grouped(rows: list, rate_key: str | None) -> list[str]:
    """The counts line, a table of hosts and the heading of the deviating ranks' rows."""
    hosts: dict[str, list] = {}
    for row in rows:
        hosts.setdefault(row.host or "all", []).append(row)
    words = [plural(len(rows), "rank") + (f" on {len(hosts)} hosts" if len(hosts) > 1 else "")]
    words += state_counts(rows)
    steps = [r.step for r in rows if r.step is not None]
    if steps:
        low, high = min(steps), max(steps)
        words.append(f"step {low:,}" if low == high else f"steps {low:,}–{high:,}")
    rates = [r.rate for r in rows if r.rate is not None and r.state != DEAD]
    if rate_key and rates:
        words.append(f"{rate_key.replace('_per_s', '/s')} {fmt_rate(sum(rates))} in total")
    stragglers = [r for r in rows if r.straggler]
    if stragglers:
        named = ", ".join(f"rank {r.rank} ({r.straggler})" for r in stragglers[:3])
        more = f" and {len(stragglers) - 3} more" if len(stragglers) > 3 else ""
        words.append(f"straggler{'s' if len(stragglers) > 1 else ''}: {named}{more}")
    table = []
    for host, members in hosts.items():
        own = [r.step for r in members if r.step is not None]
        span = (
            "–" if not own else f"{min(own)}" if min(own) == max(own) else f"{min(own)}–{max(own)}"
        )
        mine = [r.rate for r in members if r.rate is not None and r.state != DEAD]
        table.append(
            [
                host,
                str(len(members)),
                *(str(sum(1 for r in members if r.state == s)) for s in (BUSY, IDLE, DEAD)),
                span,
                fmt_rate(sum(mine)) if mine else "–",
            ]
        )
    odd = deviating_rows(rows)
    return [
        " · ".join(words),
        format_table(
            ["host", "ranks", BUSY, IDLE, DEAD, "steps", "throughput"], table, right=range(1, 7)
        ),
        f"{plural(len(odd), 'rank')} deviating (dead, stopped or held, straggling, busy while "
        "the others are idle, a NaN/inf loss, or no points)" + (":" if odd else ""),
    ]


def _title(run) -> str:
    parts = [f"run {run.id}", plural(run.world_size, "rank")]
    if run.backend:
        parts.append(run.backend)
    if run.label:
        parts.append(run.label)
    count = run.count()
    parts.append(plural(count, "point") if count else "no points yet")
    if getattr(run, "ended", None) is not None:
        parts.append("finished")  # the sidebar's word for a run whose session stopped
    return " · ".join(parts)


def _stats(run, key: str) -> tuple:
    """``(last, mean, min, max, ranks whose latest value is NaN/inf, ranks with a value)``.

    ``last`` takes each rank's latest value as it is: leaving NaN out there would show a
    finite loss for a run whose every rank diverged. Mean, min and max are of the finite
    values (one NaN would otherwise hide every other figure).
    """
    import numpy as np

    lasts: list[float] = []
    broken: list[int] = []
    chunks = []
    for rank in run.ranks:
        _, values = run.series(key, rank)
        y = np.asarray(values, dtype=np.float64)  # None (not carried by the wire) -> NaN
        if not y.size:
            continue
        lasts.append(float(y[-1]))
        if not np.isfinite(y[-1]):
            broken.append(rank)
        chunks.append(y[np.isfinite(y)])
    if not lasts:
        return (None, None, None, None, [], 0)
    every = np.concatenate(chunks)
    with np.errstate(invalid="ignore"):  # inf and -inf together: NaN, as it should read
        last = float(np.mean(lasts))
    if not every.size:
        return (last, None, None, None, broken, len(lasts))
    return (last, float(every.mean()), float(every.min()), float(every.max()), broken, len(lasts))
