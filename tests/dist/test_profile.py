"""``nbdist.profile`` and ``%dist_profile`` on real engines (2 CPU ranks, gloo, real torch.profiler):
one merged, time-aligned Chrome trace with a process row per rank, and its summary."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.driver.trace_merge import collect, profiles_dir
from nbdist.engine import profiling

# A DDP loop: every step all_reduces the gradients (communication) and logs.
SETUP = """
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 64)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 128), torch.randn(32, 64)

def train_step():
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()
"""
LOGGING_LOOP = "for step in range({n}):\n    nbdist.log(step=step, loss=train_step())\n"

# Shares are sums and differences of interval lengths (µs, ≤ ~1e7 each here) over a
# window of the same size, computed in float64: each of the ≤ ~1e4 additions rounds by at
# most 2**-52 of the window, so the three shares sum to 1 within ~1e4 * 2.2e-16 ≈ 2e-12.
# 1e-9 leaves room and still catches any time counted twice or not at all (≥ 1 µs of a
# window of a few ms is ≥ 1e-4).
SHARE_TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    history = str(tmp_path_factory.mktemp("history") / "runs.sqlite")
    with nbdist.DistSession(2, cpu=True, timeout=120, history=history) as s:
        s.run(SETUP, sink=ListSink())
        yield s


@pytest.fixture()
def shell(session):
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    magics = sh.magics_manager.registry["DistMagics"]
    before, magics.session = magics.session, session
    yield sh
    magics.session = before


def rank_temp_files(session) -> list:
    code = (
        f"from {profiling.__name__} import ready as _ready\n"
        "_held = [r.get('path') for r in _ready() if r.get('path')]"
    )
    session.run(code, sink=ListSink())
    return session.pull("_held")


def step_spans(trace: dict) -> dict[int, list[tuple[float, float]]]:
    """{rank: [(start, end)] of its recorded ProfilerStep events}, in merged time."""
    found: dict[int, list] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"):
            found.setdefault(e["pid"], []).append((e["ts"], e["ts"] + e["dur"]))
    return found


def test_with_block_merges_one_row_per_rank_time_aligned(session):
    session.run(
        "with nbdist.profile(steps=3) as prof:\n"
        + textwrap.indent(LOGGING_LOOP.format(n=6), "    "),
        sink=ListSink(),
    )
    assert session.pull("prof.steps_recorded") == [3, 3]
    merged = collect(session)
    assert merged is not None and merged.ranks == [0, 1] and merged.steps == {0: 3, 1: 3}
    assert os.path.dirname(merged.path) == profiles_dir(session)
    assert os.path.dirname(profiles_dir(session)).endswith("profiles")
    with open(merged.path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1"}
    assert {e["pid"] for e in events} == {0, 1}  # every event's pid is a rank
    for r in (0, 1):
        ops = [e for e in events if e["pid"] == r and e.get("cat") == "cpu_op"]
        assert any(e["name"] == "aten::addmm" for e in ops)
        assert any(e["name"] == "c10d::allreduce_" for e in ops)
        assert any(
            e.get("ph") == "M" and e["name"] == "thread_name" for e in events if e["pid"] == r
        )
    # Both ranks ran the same 3 steps in lockstep (DDP all_reduces each step): after
    # alignment their recorded windows must intersect.
    spans = {
        r: (min(a for a, _ in iv), max(b for _, b in iv)) for r, iv in step_spans(trace).items()
    }
    assert set(spans) == {0, 1}
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values())
    # The ranks' temporary traces are gone once merged.
    assert rank_temp_files(session) == [[], []]


def test_summary_has_a_row_per_rank_and_shares_sum_to_one(session):
    session.run(
        "with nbdist.profile(steps=2, skip=0):\n"
        + textwrap.indent(LOGGING_LOOP.format(n=3), "    "),
        sink=ListSink(),
    )
    merged = collect(session)
    assert [row.rank for row in merged.summary] == [0, 1]
    for row in merged.summary:
        total = row.compute + row.communication + row.idle
        assert total == pytest.approx(1.0, abs=SHARE_TOLERANCE)
        assert row.compute > 0 and row.communication > 0 and row.steps == 2
        assert row.overlap is not None and 0 <= row.overlap <= 1
        assert row.top_ops and all(ms >= 0 for _, ms, _ in row.top_ops)
    table = merged.to_pandas()
    assert list(table["rank"]) == [0, 1]
    report = merged.report()
    assert merged.path in report and "https://ui.perfetto.dev" in report


def test_clock_offsets_on_one_host_are_within_half_a_round_trip(session):
    from nbdist.driver.trace_merge import measure_offsets

    offsets = measure_offsets(session)
    assert sorted(offsets) == [0, 1]
    for o in offsets.values():
        assert o.rtt_ns > 0 and abs(o.offset_ns) * 2 <= o.rtt_ns and o.applied_ns == 0


def test_explicit_step_counts_steps_without_log(session):
    code = (
        "with nbdist.profile(steps=2) as prof:\n"
        "    for _ in range(5):\n"
        "        train_step()\n"
        "        prof.step()\n"
    )
    session.run(code, sink=ListSink())
    assert session.pull("prof.steps_recorded") == [2, 2]
    merged = collect(session)
    assert merged.steps == {0: 2, 1: 2}
    assert [row.steps for row in merged.summary] == [2, 2]


def test_dist_profile_magic_on_a_logging_loop_writes_the_file(session, shell, capsys):
    shell.run_line_magic("dist_profile", "2")
    assert "profiling 2 steps" in capsys.readouterr().out
    result = shell.run_cell("%%on_all_ranks\n" + LOGGING_LOOP.format(n=5))
    assert result.success
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("nbdist: merged profile of 2 ranks"))
    path = line.rsplit(": ", 1)[1]
    assert os.path.isfile(path) and path.startswith(profiles_dir(session))
    assert "https://ui.perfetto.dev" in out
    with open(path) as f:
        trace = json.load(f)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert {r: len(iv) for r, iv in step_spans(trace).items()} == {0: 2, 1: 2}
    # Once the profile ended, nbdist.log calls nothing of it any more.
    session.run(
        "from nbdist.metrics.log import step_hooks\n_plain = step_hooks == []", sink=ListSink()
    )
    assert session.pull("_plain") == [True, True]


def test_dist_profile_collect_stops_a_profile_cut_short(session, shell, capsys):
    shell.run_line_magic("dist_profile", "50")
    session.run(LOGGING_LOOP.format(n=4), sink=ListSink())  # not through the shell: no gather
    shell.run_line_magic("dist_profile", "--collect")
    out = capsys.readouterr().out
    # Started at the 1st log call, 1 step skipped, 2 completed, the 3rd cut short by --collect.
    assert "nbdist: merged profile of 2 ranks (ranks 0-1: 2 steps)" in out


# A loop without collectives, for one rank alone.
LOCAL_LOOP = "for step in range({n}):\n    torch.randn(64, 64) @ torch.randn(64, 64)\n    nbdist.log(step=step)\n"


def test_a_cell_that_raises_stops_its_profile_and_keeps_the_steps(session, shell, capsys):
    shell.run_line_magic("dist_profile", "5")
    capsys.readouterr()
    # 4 log calls: the 1st starts the profile, 1 step skipped, 2 recorded, then it raises.
    cell = "%%on_all_ranks\n" + LOGGING_LOOP.format(n=4) + "raise ValueError('boom')\n"
    assert not shell.run_cell(cell).success
    out = capsys.readouterr().out
    assert "nbdist: merged profile of 2 ranks (ranks 0-1: 2 steps)" in out, out
    assert "nbdist: profile stopped at the cell's end after 2 of 5 steps" in out, out
    # Nothing of it runs on: the next cells neither record nor refuse a new profile.
    session.run(
        "from nbdist.engine import profiling as _p\n_idle = _p._active is None and _p._armed is None",
        sink=ListSink(),
    )
    assert session.pull("_idle") == [True, True]


def test_dist_profile_while_a_profile_records_is_a_usage_error(session, shell, capsys):
    from IPython.core.error import UsageError

    # A profile recording in a thread, beyond the cell that started it.
    code = (
        "import threading, time\n"
        "def _bg():\n"
        "    with nbdist.profile(steps=500, skip=0):\n"
        "        for i in range(400):\n"
        "            nbdist.log(step=i)\n"
        "            time.sleep(0.01)\n"
        "_bg_thread = threading.Thread(target=_bg, daemon=True)\n"
        "_bg_thread.start()\n"
        "time.sleep(0.2)\n"
    )
    session.run(code, sink=ListSink())
    try:
        with pytest.raises(UsageError, match="a profile is still recording on the ranks"):
            shell.run_line_magic("dist_profile", "5")
    finally:
        shell.run_line_magic("dist_profile", "--collect")  # stops it at the thread's next step
        session.run("_bg_thread.join(timeout=30)", sink=ListSink())
        collect(session)
    capsys.readouterr()


def test_profiles_of_different_cells_are_never_merged(session):
    # Cell A: rank 0 alone profiles (not gathered); cell B: both ranks profile.
    alone = "if nbdist.rank() == 0:\n    with nbdist.profile(steps=2):\n"
    session.run(alone + textwrap.indent(LOCAL_LOOP.format(n=4), "        "), sink=ListSink())
    session.run("import time; time.sleep(1.0)", sink=ListSink())
    session.run(
        "with nbdist.profile(steps=2):\n" + textwrap.indent(LOGGING_LOOP.format(n=4), "    "),
        sink=ListSink(),
    )
    merged = collect(session)
    assert merged.ranks == [0, 1]
    with open(merged.path) as f:
        spans = step_spans(json.load(f))
    windows = {r: (min(a for a, _ in iv), max(b for _, b in iv)) for r, iv in spans.items()}
    # Both of cell B: DDP steps in lockstep, their windows intersect (cell A's ended 1 s before).
    assert max(s for s, _ in windows.values()) < min(e for _, e in windows.values())
    assert rank_temp_files(session) == [[], []]  # cell A's can never be merged: deleted


def test_ranks_whose_latest_profiles_are_of_different_cells_are_not_merged(session):
    for r in (0, 1):
        body = textwrap.indent(LOCAL_LOOP.format(n=4), "        ")
        code = f"if nbdist.rank() == {r}:\n    with nbdist.profile(steps=2):\n" + body
        session.run(code, sink=ListSink())
    merged = collect(session)
    assert merged.ranks == [1]
    assert "rank(s) [0] left out: their latest profile ended before the others began" in (
        merged.report()
    )
    assert rank_temp_files(session) == [[], []]


def test_trace_files_never_gathered_do_not_outlive_the_rank(tmp_path):
    history = str(tmp_path / "runs.sqlite")
    code = "with nbdist.profile(steps=1):\n" + textwrap.indent(LOCAL_LOOP.format(n=3), "    ")
    with nbdist.DistSession(1, cpu=True, timeout=120, history=history) as s:
        s.run(code, sink=ListSink())
        (held,) = rank_temp_files(s)
        assert len(held) == 1
    # Never gathered, and the rank gone: nothing of it is left on disk.
    assert not os.path.exists(held[0]) and not os.path.exists(os.path.dirname(held[0]))


def test_a_scripts_trace_file_is_private(tmp_path):
    # Outside a session (torchrun): the file stays where trace_path says, 0600.
    with profiling.profile(steps=1, skip=0) as prof:
        for _ in range(2):
            prof.step()
    try:
        assert os.stat(prof.trace_path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(prof.trace_path)).st_mode & 0o777 == 0o700
    finally:
        profiling.discard(prof.seq)
    assert not os.path.exists(prof.trace_path)


def test_a_profile_armed_before_a_restart_is_armed_again_on_the_fresh_ranks(session, shell, capsys):
    # Last in this module: the restart empties the ranks' namespaces.
    shell.run_line_magic("dist_profile", "2")
    assert shell.run_cell("%dist_restart").success
    assert (
        "nbdist: the ranks were restarted before the profile was taken: %dist_profile 2 armed "
        "again on the new ones, from their next nbdist.log call"
    ) in capsys.readouterr().out
    session.run(SETUP, sink=ListSink())
    assert shell.run_cell("%%on_all_ranks\n" + LOGGING_LOOP.format(n=5)).success
    out = capsys.readouterr().out
    assert "nbdist: merged profile of 2 ranks (ranks 0-1: 2 steps)" in out, out
