"""Kernel side: the rows of ``%dist_status``, what each rank is doing, read without disturbing it.

Everything comes from the controller (queue state, heartbeats) and from the
operating system (memory by PID for local ranks): asking a busy rank itself
would wait behind the cell it is running. States are :mod:`nbdist.rank_states`'s.
The one question ranks answer is their GPU's figures, and only ranks whose
device is a GPU are asked: on the engine's control channel, answered by the
rank's control thread while a cell runs (:mod:`nbdist.engine.control`). A row
has a ``gpu`` entry only when its rank answered with one, and the table has
GPU columns only when some row has.

Above ``PER_RANK_UP_TO`` ranks the table is grouped (:func:`format_status`,
``%dist_status`` without ``--all``): a line of counts, one row per host with
its ranks counted by state, and the ranks that deviate listed below it —
dead, a straggler, or in a state few share (busy while the others are idle).
"""

from __future__ import annotations

import time

from nbdist.dashboard.table import PER_RANK_UP_TO, fmt_gpu_memory, fmt_gpu_temp, fmt_gpu_util
from nbdist.driver.ipp_internals import awaiting_replies, queue_status
from nbdist.driver.process_state import STOPPED_STATES, stopped_in_words
from nbdist.driver.where import control_request
from nbdist.errors import format_ranks
from nbdist.number_ranges import fold_texts
from nbdist.rank_states import BUSY, DEAD, IDLE, counts_in_words, held_word
from nbdist.text_table import format_table

__all__ = [
    "StatusTable",
    "deviating",
    "format_status",
    "rank_status",
    "status_html",
    "stragglers",
]

# A rank holding the GIL in native code does not answer; its GPU figures are then left out.
_GPU_ANSWER_TIMEOUT_S = 1.0
# A live controller answers in well under a second, with 256 ranks on 2 busy cores too.
_CONTROLLER_ANSWERS_S = 5.0
_STATES = (BUSY, IDLE, DEAD)
# Past this many, the grouped table lists the first deviating ranks (dead, stragglers) and a count.
_DEVIATING_SHOWN = 16
# Under the table when a rank died; a session gives its own (a named session is not restarted).
RESTART_HINT = "%dist_restart brings every rank back"


def _memory_and_state(pid: int) -> tuple[float | None, str]:
    """The rank's proportional set size (PSS): its own pages plus its share of shared ones,
    and its process's state (psutil's word: 'stopped', 'sleeping'...); (None, '') once gone.

    Forked ranks share torch's pages with the zygote and each other: RSS counts
    them in every rank (188 MiB a rank at 256 ranks, 23.5 GiB for a host holding
    3.7 GiB), PSS divides them among the sharers, so a host's sum is what it holds.
    """
    import psutil

    try:
        proc = psutil.Process(pid)
        state = proc.status()
        if state == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            return None, ""
        rss = proc.memory_info().rss / 2**20
    except psutil.Error:
        return None, ""
    try:
        # smaps_rollup (Linux >= 4.14) is one summed read, cheap enough for 256 ranks.
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024, state
    except (OSError, ValueError, IndexError):
        pass
    return rss, state


def _queues(client, targets: list[int], settle: bool) -> tuple[dict, set[int]]:
    """The controller's queue counts of ``targets``, and those this client awaits a reply from.

    The controller counts a request a little after it was sent and its end a little
    after the reply came: an engine this client awaits is busy whatever the counts
    say, and with ``settle`` a count the controller still keeps for an engine this
    client awaits nothing from is asked again, up to 3 times 50 ms apart (work from
    elsewhere, another kernel attached to a named session, stays busy).
    """
    attempts = 4 if settle else 1
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.05)
        waiting = awaiting_replies(client, targets)
        queues = queue_status(client, targets, timeout=_CONTROLLER_ANSWERS_S)
        lagging = [
            eid
            for eid in targets
            if eid not in waiting
            and isinstance(queues.get(eid), dict)
            and (queues[eid].get("queue", 0) or queues[eid].get("tasks", 0))
        ]
        if not lagging:
            break
    return queues, waiting


def _gpu_figures(client, ranks, alive: set[int]) -> dict[int, dict]:
    """{rank: its GPU's figures} for the live ranks on a CUDA device that gave them."""
    asked = [r for r in ranks if r.engine_id in alive and str(r.device).startswith("cuda")]
    if not asked:
        return {}
    replies = control_request(
        client, [r.engine_id for r in asked], "gpu", timeout=_GPU_ANSWER_TIMEOUT_S
    )
    return {
        info.rank: reply["gpu"]
        for info, reply in zip(asked, replies)
        if reply is not None and isinstance(reply.get("gpu"), dict)
    }


def rank_status(
    handle,
    ranks,
    backend: str | None,
    dead: dict | None = None,
    *,
    gpu: bool = True,
    dropped: dict[int, int] | None = None,
    run=None,
    settle: bool = False,
) -> list[dict]:
    """One dict per rank; ``dead``: {rank: how it died}, as the session noticed it.

    ``run``: the session's :class:`~nbdist.metrics.run.Run`; a rank its latest
    steps make a straggler (the dashboard's rule) has ``straggler``: why.

    ``dropped``: {rank: metrics points it could not send} (the run's
    :attr:`~nbdist.metrics.run.Run.dropped`); each row's ``dropped`` is that
    count (0 for a rank not in it), or None when not given.

    ``gpu``: ask the ranks on GPUs for their GPU's figures (``row["gpu"]``: ``index``,
    ``name``, ``uuid``, ``util`` %, ``mem_used_mib``, ``mem_total_mib``, ``temp_c``;
    a figure the GPU does not report is None). Rows of ranks without one have no ``gpu``.

    ``settle``: wait up to 150 ms for the controller to count a cell this kernel saw
    end (``%dist_status`` right after a cell); the dashboard's per-cell look does not.
    """
    dead = dead or {}
    client = handle.client
    alive_ids = set(client.ids)
    targets = [r.engine_id for r in ranks if r.engine_id in alive_ids]
    try:
        queues, waiting = _queues(client, targets, settle)
    except TimeoutError:
        # Slow (a large push on busy cores) is not gone: the states this kernel knows, unless
        # the controller it started has ended.
        if handle.controller_running() is False:
            queues, waiting, alive_ids = {}, set(), set()
        else:
            queues, waiting = {}, awaiting_replies(client, targets)
    except Exception:  # controller gone: every rank shows as dead below
        queues, waiting, alive_ids = {}, set(), set()
    living = [r for r in ranks if r.rank not in dead]
    gpus = _gpu_figures(client, living, alive_ids) if gpu else {}
    rows = []
    for info in ranks:
        queue = queues.get(info.engine_id, {})
        if info.engine_id not in alive_ids:
            state = DEAD
        elif info.engine_id in waiting or queue.get("queue", 0) or queue.get("tasks", 0):
            state = BUSY
        else:
            state = IDLE
        # A PID of another host (or PID namespace) names some other process here.
        local = handle.owned and info.pid_here
        memory, process = _memory_and_state(info.pid) if local else (None, "")
        if (local and memory is None) or info.rank in dead:
            state = DEAD
        rows.append(
            dict(
                rank=info.rank,
                engine=info.engine_id,
                host=info.host,
                pid=info.pid,
                device=info.device,
                backend=backend,
                state=state,
                memory_mib=None if memory is None else round(memory, 1),
                died=dead.get(info.rank),
                dropped=None if dropped is None else int(dropped.get(info.rank, 0)),
            )
        )
        if process in STOPPED_STATES and state != DEAD:
            # Idle or busy to the controller, yet it runs nothing until continued.
            rows[-1]["process"] = process
        if info.rank in gpus and state != DEAD:
            rows[-1]["gpu"] = gpus[info.rank]
    flagged = stragglers(run) if run is not None else {}
    for row in rows:
        if row["rank"] in flagged and row["state"] != DEAD:
            row["straggler"] = flagged[row["rank"]]
    return rows


def stragglers(run) -> dict[int, str]:
    """rank -> why it is a straggler, from each rank's latest points only (cheap at any length)."""
    from nbdist.dashboard.table import HISTORY, RECENT, find_stragglers, step_lags

    if "step_time" not in run.keys():
        return {}
    step_times: dict[int, list[float]] = {}
    history: dict[int, list[tuple[float, int]]] = {}
    for rank in run.ranks:
        steps, values = run.series("step_time", rank, start=-HISTORY)
        times, _ = run.timeline("step_time", rank, start=-HISTORY)
        step_times[rank] = values[-RECENT:]
        history[rank] = list(zip(times, steps))
    return find_stragglers(step_times, step_lags(history))


def _gpu_cells(gpu: dict | None) -> list[str]:
    if not gpu:
        return ["–", "–", "–", "–"]
    index, name = gpu.get("index"), gpu.get("name") or ""
    which = ("?" if index is None else str(index)) + (f" {name}" if name else "")
    return [
        which,
        fmt_gpu_util(gpu.get("util")),
        fmt_gpu_memory(gpu.get("mem_used_mib"), gpu.get("mem_total_mib")),
        fmt_gpu_temp(gpu.get("temp_c")),
    ]


def _table(
    rows: list[dict], hint: str = RESTART_HINT
) -> tuple[list[str], list[list[str]], list[str]]:
    """The headers, cells and notes both forms of the table show.

    The ipyparallel engine id is left out: it is nbdist's plumbing, differs from
    the rank after a restart, and read as a second rank number (it stays in the rows).
    """
    headers = ["rank", "host", "pid", "device", "backend", "state", "memory"]
    # Metrics points a rank logged but could not send (normally 0); when the session tells.
    with_dropped = any(r.get("dropped") is not None for r in rows)
    if with_dropped:
        headers.append("dropped")
    with_gpu = any(r.get("gpu") for r in rows)
    if with_gpu:
        headers += ["gpu", "gpu util", "gpu memory", "gpu temp"]
    table = [
        [
            str(r["rank"]),
            r["host"],
            str(r["pid"]),
            r["device"],
            str(r["backend"]),
            r["state"],
            "?" if r["memory_mib"] is None else f"{r['memory_mib']:.0f} MiB",
            *([str(r.get("dropped", "–"))] if with_dropped else []),
            *(_gpu_cells(r.get("gpu")) if with_gpu else []),
        ]
        for r in rows
    ]
    notes = []
    dead = [r for r in rows if r["state"] == DEAD]
    causes = {r["rank"]: r.get("died") or "its process is gone" for r in dead}
    for ranks, cause in fold_texts(causes):  # 40 ranks killed alike: one line
        notes.append(f"{format_ranks(ranks)} died: {cause}")
    if dead:
        notes.append(hint)
    for r in rows:
        if r.get("straggler") and r["state"] != DEAD:
            notes.append(f"rank {r['rank']} is a straggler: {r['straggler']}")
    _ranks, stopped = stopped_in_words(
        [(r["rank"], r["pid"], r["process"]) for r in rows if r.get("process")]
    )
    if stopped:
        notes.append(stopped)
    lost = sum(r.get("dropped") or 0 for r in rows)
    if lost:
        notes.append(
            f"{lost} metrics points dropped on the ranks: their buffer was full "
            "(NBDIST_LOG_BUFFER), or nbdist.log failed on them (the dashboard names the first error)"
        )
    shared = _shared_gpus(rows)
    if shared:
        notes.append(shared)
    return headers, table, notes


def deviating(rows: list[dict]) -> list[dict]:
    """The rows of ranks that stand out: dead, a straggler, stopped, or in a state few ranks share.

    "Few": at most an eighth of the living ranks, and fewer than hold the
    commonest state (busy ranks while most are idle, idle ranks while most are
    busy); a state shared more widely is told by the counts, not rank by rank.
    A row's ``straggler`` (why it is one), when given, marks it too. Dead ranks
    and stragglers come first.
    """
    living = [r for r in rows if r["state"] != DEAD]
    counts = {state: sum(1 for r in living if r["state"] == state) for state in (IDLE, BUSY)}
    common = max(counts.values(), default=0)
    few = max(1, len(living) // 8)

    def rare(r: dict) -> bool:
        n = counts.get(r["state"])
        return n is not None and n < common and n <= few

    odd = [
        r
        for r in rows
        if r["state"] == DEAD
        or r.get("straggler")
        or r.get("process")
        or rare(r)
        or (r.get("dropped") or 0) > 0
    ]
    return sorted(odd, key=lambda r: (r["state"] != DEAD, not r.get("straggler")))


def _memory(mib: float) -> str:
    return f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.0f} MiB"


def _grouped(rows: list[dict]) -> tuple[str, list[str], list[list[str]], list[dict]]:
    """The counts line, the per-host table (headers, cells) and the deviating rows."""
    hosts: dict[str, list[dict]] = {}
    for r in rows:
        hosts.setdefault(r["host"], []).append(r)
    where = f" on {len(hosts)} hosts" if len(hosts) > 1 else f" on {next(iter(hosts))}"
    held = ((r["state"], held_word(r.get("process") or "")) for r in rows)
    words = [f"{len(rows)} ranks{where}", *counts_in_words(held)]
    known = sorted(r["memory_mib"] for r in rows if r["memory_mib"] is not None)
    if known:
        words.append(f"memory {_memory(known[len(known) // 2])} per rank (median)")
    headers = ["host", "ranks", *_STATES, "memory"]
    cells = []
    for host, members in hosts.items():
        memory = [r["memory_mib"] for r in members if r["memory_mib"] is not None]
        cells.append(
            [
                host,
                str(len(members)),
                *(str(sum(1 for r in members if r["state"] == s)) for s in _STATES),
                _memory(sum(memory)) if memory else "?",
            ]
        )
    return " · ".join(words), headers, cells, deviating(rows)


def _grouped_lines(rows: list[dict], hint: str) -> list[str]:
    line, host_headers, host_cells, odd = _grouped(rows)
    lines = [line, format_table(host_headers, host_cells, right=range(1, len(host_headers)))]
    if odd:
        shown = odd[:_DEVIATING_SHOWN]
        headers, table, notes = _table(shown, hint)
        lines += [
            f"{len(odd)} rank{'s' if len(odd) > 1 else ''} deviating "
            "(%dist_status --all lists every rank):",
            format_table(headers, table),
            *notes,
        ]
        if len(odd) > len(shown):
            lines.append(f"... and {len(odd) - len(shown)} more deviating (%dist_status --all)")
    else:
        lines.append("no rank deviates (%dist_status --all lists every rank)")
    return lines


def format_status(rows: list[dict], *, all_ranks: bool = False, hint: str = RESTART_HINT) -> str:
    """A fixed-width text table of :func:`rank_status` rows, then its notes (dead ranks...).

    Above ``PER_RANK_UP_TO`` rows, unless ``all_ranks``: the counts by state, a
    row per host, and only the ranks that deviate (:func:`deviating`).
    """
    if len(rows) > PER_RANK_UP_TO and not all_ranks:
        return "\n".join(_grouped_lines(rows, hint))
    headers, table, notes = _table(rows, hint)
    return "\n".join([format_table(headers, table), *notes])


def status_html(rows: list[dict], *, all_ranks: bool = False, hint: str = RESTART_HINT) -> str:
    """The same table as HTML: each rank in its dashboard colour, a dead rank's state in red.

    Grouped by host, like :func:`format_status`, above ``PER_RANK_UP_TO`` rows
    unless ``all_ranks``.
    """
    from html import escape

    if len(rows) > PER_RANK_UP_TO and not all_ranks:
        line, host_headers, host_cells, odd = _grouped(rows)
        parts = [f"<div>{escape(line)}</div>", _html_table(host_headers, host_cells)]
        if odd:
            parts.append(
                f"<div>{len(odd)} rank{'s' if len(odd) > 1 else ''} deviating "
                "(<code>%dist_status --all</code> lists every rank):</div>"
            )
            parts.append(_rank_html(odd[:_DEVIATING_SHOWN], hint))
            if len(odd) > _DEVIATING_SHOWN:
                parts.append(
                    f"<div>... and {len(odd) - _DEVIATING_SHOWN} more deviating "
                    "(<code>%dist_status --all</code>)</div>"
                )
        else:
            parts.append(
                "<div>no rank deviates (<code>%dist_status --all</code> lists every rank)</div>"
            )
        return "".join(parts)
    return _rank_html(rows, hint)


def _html_table(headers: list[str], cells: list[list[str]]) -> str:
    from html import escape

    head = "".join(f"<th style='text-align:left'>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td style='text-align:left'>{escape(c)}</td>" for c in row) + "</tr>"
        for row in cells
    )
    return (
        f"<table class='nbdist-status'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _rank_html(rows: list[dict], hint: str) -> str:
    from html import escape

    from nbdist.dashboard.palette import rank_colour

    headers, table, notes = _table(rows, hint)
    head = "".join(f"<th style='text-align:left'>{escape(h)}</th>" for h in headers)
    body = []
    for r, cells in zip(rows, table):
        tds = []
        for h, c in zip(headers, cells):
            text = escape(c)
            if h == "rank":
                swatch = f"<span style='color:{rank_colour(int(r['rank']))}'>&#9632;</span> "
                text = swatch + text
            elif h == "state" and c == DEAD:
                text = f"<b style='color:#c62828'>{text}</b>"
            tds.append(f"<td style='text-align:left'>{text}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    foot = "".join(f"<div>{escape(n)}</div>" for n in notes)
    return (
        f"<table class='nbdist-status'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>{foot}"
    )


class StatusTable:
    """What ``%dist_status`` displays: HTML in a notebook, the text table elsewhere."""

    def __init__(self, rows: list[dict], *, all_ranks: bool = False, hint: str = RESTART_HINT):
        """``rows``: :func:`rank_status`'s; ``all_ranks``: a row per rank at any number of ranks.

        ``hint``: what brings dead ranks back, said under the table when a rank died
        (a named session's is not ``%dist_restart``: the session's ``restart_hint()``).
        """
        self.rows = rows
        self.all_ranks = all_ranks
        self.hint = hint

    def __repr__(self) -> str:
        """The text table (a terminal, a saved notebook's text/plain)."""
        return format_status(self.rows, all_ranks=self.all_ranks, hint=self.hint)

    def _repr_html_(self) -> str:
        return status_html(self.rows, all_ranks=self.all_ranks, hint=self.hint)


def _shared_gpus(rows: list[dict]) -> str:
    """A note naming the GPUs several ranks share (their figures are the whole GPU's)."""
    by_gpu: dict[tuple, list[int]] = {}
    for r in rows:
        gpu = r.get("gpu")
        if gpu and (gpu.get("uuid") or gpu.get("index") is not None):
            by_gpu.setdefault((r["host"], gpu.get("uuid") or gpu.get("index")), []).append(
                r["rank"]
            )
    notes = []
    for (host, _), ranks in by_gpu.items():
        if len(ranks) > 1:
            index = next(r["gpu"].get("index") for r in rows if r["rank"] == ranks[0])
            notes.append(f"ranks {', '.join(map(str, ranks))} share GPU {index} on {host}")
    if not notes:
        return ""
    return "; ".join(notes) + " (gpu figures are the whole GPU's)"
