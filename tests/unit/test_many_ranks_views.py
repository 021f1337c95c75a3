"""%dist_status and the dashboard's text summary at many ranks: hosts with counts, the ranks that deviate."""

from __future__ import annotations

from nbdist.dashboard.table import PER_RANK_UP_TO
from nbdist.dashboard.text import summary_text
from nbdist.driver.status import StatusTable, deviating, format_status
from nbdist.metrics.run import Run
from nbdist.rank_states import HeldState

T0 = 1_700_000_000.0


def rows(n, hosts=8, busy=(), dead=(), memory=100.0):
    per_host = n // hosts
    return [
        dict(
            rank=r,
            engine=r,
            host=f"node{r // per_host}",
            pid=1000 + r,
            device="cpu",
            backend="gloo",
            state="dead" if r in dead else "busy" if r in busy else "idle",
            memory_mib=None if r in dead else memory,
            died="pid killed by SIGKILL (signal 9)" if r in dead else None,
            dropped=0,
        )
        for r in range(n)
    ]


def test_many_ranks_are_grouped_by_host_with_only_the_deviating_ranks_listed():
    text = format_status(rows(256, busy={17}, dead={200}))
    lines = text.splitlines()
    assert lines[0] == (
        "256 ranks on 8 hosts · 1 busy · 254 idle · 1 dead · memory 100 MiB per rank (median)"
    )
    assert lines[1].split() == ["host", "ranks", "busy", "idle", "dead", "memory"]
    assert lines[2].split() == ["node0", "32", "1", "31", "0", "3.1", "GiB"]
    assert lines[8].split() == ["node6", "32", "0", "31", "1", "3.0", "GiB"]
    assert lines[10] == "2 ranks deviating (%dist_status --all lists every rank):"
    listed = [line.split()[0] for line in lines[12:14]]
    assert listed == ["200", "17"]  # the dead first
    assert "rank 200 died: pid killed by SIGKILL (signal 9)" in lines
    assert len(lines) < 20  # not 256 rows


def test_all_ranks_lists_every_rank_and_small_sessions_stay_per_rank():
    assert len(format_status(rows(256), all_ranks=True).splitlines()) == 257
    small = format_status(rows(PER_RANK_UP_TO, hosts=1)).splitlines()
    assert small[0].split()[:2] == ["rank", "host"] and len(small) == PER_RANK_UP_TO + 1


def test_no_deviation_is_said_and_a_straggler_deviates():
    steady = rows(32, hosts=2)
    assert format_status(steady).splitlines()[-1] == (
        "no rank deviates (%dist_status --all lists every rank)"
    )
    steady[5]["straggler"] = "1.6× step time"
    assert [r["rank"] for r in deviating(steady)] == [5]
    assert "rank 5 is a straggler: 1.6× step time" in format_status(steady)


def test_a_stopped_rank_deviates_and_is_named_with_the_command_that_continues_it():
    # Idle to the controller (its heartbeat allows 30 s of silence), stopped to the process table.
    table = rows(256)
    table[42]["process"] = "stopped"
    assert [r["rank"] for r in deviating(table)] == [42]
    text = format_status(table)
    # Counted idle (the controller's word), and stopped beside it.
    assert text.splitlines()[0].startswith("256 ranks on 8 hosts · 256 idle (1 stopped) · "), text
    assert "1 rank deviating (%dist_status --all lists every rank):" in text
    assert text.splitlines()[-1] == (
        "the process here of rank 42 (pid 1042) is stopped (SIGSTOP, or Ctrl-Z in its "
        "terminal): `kill -CONT 1042` lets it go on"
    )


def test_busy_ranks_deviate_only_while_most_are_idle():
    half = rows(16, hosts=1, busy=set(range(8)))
    assert deviating(half) == []  # as many busy as idle: the counts say it
    most = rows(16, hosts=1, busy=set(range(15)))
    assert [r["rank"] for r in deviating(most)] == [15]  # the one idle while the others work


def test_a_state_many_ranks_share_is_counted_not_listed():
    # Seen at 256 ranks just after a cell: 119 ranks still busy in the controller's books for
    # a moment; listing them one by one was 119 lines.
    many_busy = rows(256, busy=set(range(119)))
    assert deviating(many_busy) == []
    assert format_status(many_busy).splitlines()[0].startswith("256 ranks on 8 hosts · 119 busy")
    few_busy = rows(256, busy=set(range(32)))  # an eighth: still "busy while the others idle"
    assert len(deviating(few_busy)) == 32


def test_a_long_deviating_list_is_cut_after_the_dead_and_the_stragglers():
    many = rows(256, busy=set(range(30)), dead={250, 251})
    many[100]["straggler"] = "1.6× step time"
    lines = format_status(many).splitlines()
    assert lines[10] == "33 ranks deviating (%dist_status --all lists every rank):"
    listed = [line.split()[0] for line in lines[12:15]]
    assert listed == ["250", "251", "100"]
    assert lines[-1] == "... and 17 more deviating (%dist_status --all)"
    assert len(lines) < 40
    html = StatusTable(many)._repr_html_()
    assert "and 17 more deviating" in html


def test_html_is_grouped_the_same_way():
    html = StatusTable(rows(64, busy={3})).__repr__(), StatusTable(rows(64, busy={3}))._repr_html_()
    text, markup = html
    assert "1 rank deviating" in text
    assert "node7" in markup and "%dist_status --all</code> lists every rank" in markup
    assert markup.count("<tr>") == 1 + 8 + 1 + 1  # host table header + rows, rank header + row
    every = StatusTable(rows(64), all_ranks=True)._repr_html_()
    assert every.count("<tr>") == 65


# -- the dashboard's text summary -------------------------------------------------------------


def _training_run(n, *, slow=None, steps=40):
    run = Run(4, world_size=n, backend="gloo", started=T0)
    run.hosts = {r: f"node{r // 32}" for r in range(n)}
    for rank in range(n):
        dt = 0.2 if rank == slow else 0.1
        scalars = {"samples": 64.0, "step_time": dt, "samples_per_s": 64.0 / dt}
        run.add(
            rank, [(s, T0 + 1 + s * dt, {"loss": 1.0 / (s + 1), **scalars}) for s in range(steps)]
        )
    return run


def test_summary_of_many_ranks_groups_by_host_and_names_the_straggler():
    run = _training_run(256, slow=17)
    text = summary_text(run, {200: "dead"}, now=T0 + 60)
    lines = text.splitlines()
    assert "256 ranks on 8 hosts" in lines[1]
    assert "straggler: rank 17 (2.0× step time)" in lines[1]
    assert "1 dead" in lines[1] and "steps 39" not in lines[1]
    assert lines[2].split()[:7] == ["host", "ranks", "busy", "idle", "dead", "steps", "throughput"]
    assert [line.split()[0] for line in lines[3:11]] == [f"node{h}" for h in range(8)]
    assert lines[11].startswith("2 ranks deviating")
    rows = lines[13:15]
    assert [r.split()[0] for r in rows] == ["17", "200"], rows
    assert "straggler" in rows[0] and "dead" in rows[1]
    assert len(lines) < 30, "no row per rank"


def test_summary_of_many_ranks_lists_a_held_rank_among_the_deviating_ones():
    # Stopped, rank 90 falls behind only once the others log past it: the state says why now.
    run = _training_run(256)
    held = {90: HeldState("busy", "stopped"), 91: HeldState("busy", "held by a debugger")}
    lines = summary_text(run, {r: held.get(r, "busy") for r in range(256)}, now=T0 + 1).splitlines()
    assert lines[11].startswith("2 ranks deviating"), lines
    assert [(r.split()[0], r.split("  ")[-1]) for r in lines[13:15]] == [
        ("90", "busy · stopped"),
        ("91", "busy · held by a debugger"),
    ], lines
    # Still counted busy (the controller's word), and the held among them beside it.
    assert "256 ranks on 8 hosts · 256 busy (1 held by a debugger, 1 stopped) · " in lines[1], lines


def test_summary_of_a_few_ranks_keeps_a_row_per_rank():
    lines = summary_text(_training_run(PER_RANK_UP_TO), now=T0 + 60).splitlines()
    assert [line.split()[0] for line in lines[2 : 2 + PER_RANK_UP_TO]] == [
        f"{r}" for r in range(PER_RANK_UP_TO)
    ]


def test_status_names_one_slow_rank_among_256():
    from nbdist.driver.status import stragglers

    assert stragglers(_training_run(256, slow=201)) == {201: "2.0× step time"}
    assert stragglers(_training_run(256)) == {}


def _breakdown_run(n, *, slow=None, near=()):
    """``n`` ranks logging the step breakdown: ``slow`` spends most of its step loading data,
    ``near`` ranks a little more time communicating than the others (not a straggler)."""
    run = Run(5, world_size=n, backend="gloo", started=T0)
    for rank in range(n):
        data, compute, comm = (0.3, 0.1, 0.0) if rank == slow else (0.0, 0.09, 0.01)
        if rank in near:
            compute, comm = 0.087, 0.013
        dt = data + compute + comm
        parts = {"step_time": dt, "data_s": data, "compute_s": compute, "comm_s": comm}
        run.add(rank, [(s, T0 + 1 + s * dt, {"loss": 1.0 / (s + 1), **parts}) for s in range(20)])
    return run


def _breakdown(text):
    lines = text.splitlines()
    start = lines.index("step breakdown (latest steps):")
    return [line for line in lines[start + 1 :] if line.startswith("  ")]


def test_the_step_breakdown_of_many_ranks_is_the_common_one_once_and_the_deviating_ranks():
    run = _breakdown_run(256, slow=17, near=(40, 41))
    text = summary_text(run, now=T0 + 60)
    assert "straggler: rank 17" in text
    assert _breakdown(text) == [
        "  ranks 0-16,18-39,42-255: data loading 0 % · compute 90 % · communication 10 %",
        "  rank 17: data loading 75 % · compute 25 % · communication 0 %",
        "  2 other ranks (not deviating): each part within 3 % of these",
    ]


def test_the_step_breakdown_of_a_few_ranks_groups_equal_shares():
    run = _breakdown_run(PER_RANK_UP_TO, slow=3)
    assert _breakdown(summary_text(run, now=T0 + 60)) == [
        f"  ranks 0-2,4-{PER_RANK_UP_TO - 1}: data loading 0 % · compute 90 % · communication 10 %",
        "  rank 3: data loading 75 % · compute 25 % · communication 0 %",
    ]


def test_step_breakdown_percents_add_up_to_100():
    # Each rounded alone, thirds read "33 % · 33 % · 33 %" (99) and 1/6, 5/12, 5/12 read
    # "17 % · 42 % · 42 %" (101).
    from nbdist.dashboard.text import whole_percents

    for fractions in ([1 / 3] * 3, [1 / 6, 5 / 12, 5 / 12], [0.154, 0.423, 0.423], [0, 0, 1]):
        shown = whole_percents(fractions)
        assert sum(shown) == 100, (fractions, shown)
        assert all(abs(s - 100 * f) < 1 for s, f in zip(shown, fractions)), (fractions, shown)
    assert whole_percents([0.154, 0.423, 0.423]) == [16, 42, 42]
