"""Unit tests for folding a cell's lines across ranks (nbdist.driver.output_fold) and its sinks."""

from __future__ import annotations

import pytest

from nbdist.driver import cell_output
from nbdist.driver.output import LIVE_FOLD_AFTER_S, LIVE_FOLD_S, OutputMerger
from nbdist.driver.output_fold import LineFold, fold_key, lines_per_rank
from nbdist.driver.sinks import KernelSink, ListSink
from nbdist.errors import NbdistError

C10D = (
    "[W1128 08:32:{s:02d}.{ns:09d} socket.cpp:207] [c10d] The hostname of the client socket "
    "cannot be retrieved. err=-3"
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def folded(lines):
    """``[label] text`` of a fold, as a notebook shows it."""
    return [f"[{label}] {text}" for _stream, label, text in lines]


# -- fold_key -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (C10D.format(s=42, ns=606441197), C10D.format(s=43, ns=1)),
        (
            "[rank3]:[W1128 08:32:42.606441197 ProcessGroupNCCL.cpp:4561] process group not destroyed",
            "[rank7]:[W1128 08:32:44.000000001 ProcessGroupNCCL.cpp:4561] process group not destroyed",
        ),
        (
            "W1128 08:32:42.606441 12345 socket.cc:10] slow peer",
            "W1128 08:32:45.000001 99 socket.cc:10] slow peer",
        ),
        (
            "node1:12345:12367 [0] NCCL INFO Using network Socket",
            "node1:12399:12400 [3] NCCL INFO Using network Socket",
        ),
        (
            "[Gloo] Rank 0 is connected to 255 peer ranks.",
            "[Gloo] Rank 17 is connected to 255 peer ranks.",
        ),
        (
            "2026-11-28 08:32:42,606 - INFO - loading shards",
            "2026-11-28 08:32:43,001 - INFO - loading shards",
        ),
        (
            "11/28/2026 08:32:42 - INFO - accelerate - ready",
            "11/28/2026 08:32:59 - INFO - accelerate - ready",
        ),
    ],
)
def test_lines_differing_only_in_a_library_prefix_have_one_key(a, b):
    assert a != b
    assert fold_key(a) == fold_key(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("epoch 1 done", "epoch 2 done"),
        ("[W socket.cpp:207] a", "[W socket.cpp:208] a"),  # another place in the library
        ("loss 0.25 at 08:32:42", "loss 0.25 at 08:32:43"),  # a time inside the message
        (
            "[Gloo] Rank 0 is connected to 3 peer ranks.",
            "[Gloo] Rank 0 is connected to 2 peer ranks.",
        ),
    ],
)
def test_lines_differing_in_their_message_keep_apart(a, b):
    assert fold_key(a) != fold_key(b)


# -- LineFold -------------------------------------------------------------------------------


def test_each_distinct_line_once_with_its_ranks_whatever_the_arrival_order():
    fold = LineFold()
    # 32 ranks at different paces: rank r is r steps "late", interleaved arbitrarily.
    arrivals = sorted((e * 3 + r % 5, r, e) for r in range(32) for e in range(3))
    for _, rank, epoch in arrivals:
        fold.add(rank, "stdout", f"epoch {epoch} done")
    assert folded(fold.render()) == [
        "[ranks 0-31] epoch 0 done",
        "[ranks 0-31] epoch 1 done",
        "[ranks 0-31] epoch 2 done",
    ]


def test_a_line_repeated_on_each_rank_is_shown_as_often_as_each_printed_it():
    fold = LineFold()
    for rank in (0, 1, 2):
        for _ in range(3):
            fold.add(rank, "stdout", "tick")
    fold.add(0, "stdout", "tick")  # rank 0 once more
    assert folded(fold.render()) == ["[ranks 0-2] tick"] * 3 + ["[rank 0] tick"]


def test_different_lines_at_one_place_are_listed_in_rank_order():
    fold = LineFold()
    for rank in (3, 1, 0, 2):
        fold.add(rank, "stdout", "start")
        fold.add(rank, "stdout", f"loss {rank}")
        fold.add(rank, "stdout", "end")
    assert folded(fold.render()) == [
        "[ranks 0-3] start",
        "[rank 0] loss 0",
        "[rank 1] loss 1",
        "[rank 2] loss 2",
        "[rank 3] loss 3",
        "[ranks 0-3] end",
    ]


def test_every_rank_keeps_its_own_order():
    fold = LineFold()
    fold.add(1, "stdout", "x")  # rank 1 prints x first, before rank 0 printed anything
    fold.add(0, "stdout", "header")
    fold.add(0, "stdout", "x")
    fold.add(1, "stdout", "y")
    fold.add(0, "stdout", "y")
    assert folded(fold.render()) == ["[rank 0] header", "[ranks 0-1] x", "[ranks 0-1] y"]


def test_opposite_orders_on_two_ranks_still_show_every_line_once():
    fold = LineFold()
    for line in ("a", "b"):
        fold.add(0, "stdout", line)
    for line in ("b", "a"):
        fold.add(1, "stdout", line)
    assert sorted(folded(fold.render())) == ["[ranks 0-1] a", "[ranks 0-1] b"]


def test_library_warnings_fold_to_one_line_shown_as_the_lowest_rank_printed_it():
    fold = LineFold()
    for rank in reversed(range(256)):
        fold.add(rank, "stderr", C10D.format(s=rank % 60, ns=rank))
    [(stream, label, text)] = fold.render()
    assert (stream, label) == ("stderr", "ranks 0-255")
    assert text == C10D.format(s=0, ns=0)
    assert fold.rank_lines(7) == [C10D.format(s=7, ns=7)]  # each rank's own text is kept


def test_warnings_from_cell_code_fold_across_ranks_whatever_their_ipykernel_file():
    """Each rank compiles a cell to its own /tmp/ipykernel_<pid>/<hash>.py: masked to compare."""
    fold = LineFold()
    for rank in reversed(range(256)):
        cell = f"/tmp/ipykernel_{14322 + rank}/{276219731 + rank % 3}.py"
        fold.add(rank, "stderr", f"{cell}:2: UserWarning: careful now")
        fold.add(rank, "stderr", "  warnings.warn('careful now')")
        fold.add(rank, "stderr", f'  File "{cell}", line 2, in <module>')
    assert folded(fold.render()) == [
        "[ranks 0-255] /tmp/ipykernel_14322/276219731.py:2: UserWarning: careful now",
        "[ranks 0-255]   warnings.warn('careful now')",
        '[ranks 0-255]   File "/tmp/ipykernel_14322/276219731.py", line 2, in <module>',
    ]
    # Another line of the cell, or another warning, stays apart.
    assert fold_key("/tmp/ipykernel_1/2.py:3: UserWarning: careful now") != fold_key(
        "/tmp/ipykernel_1/2.py:2: UserWarning: careful now"
    )
    assert fold_key("/tmp/ipykernel_1/2.py:2: UserWarning: other") != fold_key(
        "/tmp/ipykernel_1/2.py:2: UserWarning: careful now"
    )


def test_streams_fold_separately():
    fold = LineFold()
    for rank in (0, 1):
        fold.add(rank, "stdout", "same")
        fold.add(rank, "stderr", "same")
    assert [(s, label) for s, label, _ in fold.render()] == [
        ("stdout", "ranks 0-1"),
        ("stderr", "ranks 0-1"),
    ]


def test_more_lines_than_the_limit_keep_each_ranks_tail_and_say_where_the_rest_is():
    fold = LineFold()
    for rank in range(4):
        for i in range(30):
            fold.add(rank, "stdout", f"step {i}")
    for i in range(15):
        fold.add(2, "stdout", f"rank 2 only {i}")
    lines = folded(fold.render(per_rank=10))
    assert lines[:2] == [
        "[ranks 0-1,3] … 20 earlier lines not shown (the last 10 of each rank are); "
        "nbdist.output(rank=0) has all of a rank's output",
        "[rank 2] … 25 earlier lines not shown (the last 10 of each rank are); "
        "nbdist.output(rank=2) has all of a rank's output",
    ]
    assert lines[2:] == [f"[ranks 0-3] step {i}" for i in range(20, 30)] + [
        f"[rank 2] rank 2 only {i}" for i in range(5, 15)
    ]
    assert len(fold.render()) == 45  # no limit: everything


def test_the_live_tail_shows_the_latest_lines_and_counts_the_rest():
    fold = LineFold()
    for i in range(10):
        for rank in (0, 1):
            fold.add(rank, "stdout", f"line {i}")
    assert folded(fold.tail(3)) == [
        "[ranks 0-1] … 7 earlier lines, all shown when the cell ends",
        "[ranks 0-1] line 7",
        "[ranks 0-1] line 8",
        "[ranks 0-1] line 9",
    ]


def test_lines_per_rank_reads_the_environment(monkeypatch):
    monkeypatch.delenv("NBDIST_OUTPUT_LINES", raising=False)
    assert lines_per_rank() == 1000
    monkeypatch.setenv("NBDIST_OUTPUT_LINES", "0")
    assert lines_per_rank() == 0
    monkeypatch.setenv("NBDIST_OUTPUT_LINES", "many")
    with pytest.raises(ValueError, match="NBDIST_OUTPUT_LINES.*'many'"):
        lines_per_rank()


# -- through the merger ---------------------------------------------------------------------


def test_stragglers_split_the_live_lines_but_not_the_final_fold():
    sink, clock = ListSink(), FakeClock()
    merger = OutputMerger(range(32), sink, clock=clock)
    for epoch in range(3):
        for rank in range(32):
            if rank in (22, 25, 27):
                continue  # late this time
            merger.feed(rank, "stdout", f"epoch {epoch} done\n")
        clock.now += 0.2  # past the window: the others go out without them
        merger.poll()
        for rank in (22, 25, 27):
            merger.feed(rank, "stdout", f"epoch {epoch} done\n")
        clock.now += 0.2
        merger.poll()
    merger.close()
    live = [e for e in sink.events if e[0] == "line"]
    assert len(live) == 6  # what a terminal shows: the latecomers on lines of their own
    assert sink.folds == [
        [("stdout", "ranks 0-31", f"epoch {e} done") for e in range(3)],
    ]


def test_live_grouping_ignores_library_timestamps():
    sink = ListSink()
    merger = OutputMerger([0, 1], sink, clock=FakeClock())
    merger.feed(0, "stderr", C10D.format(s=1, ns=5) + "\n")
    merger.feed(1, "stderr", C10D.format(s=2, ns=9) + "\n")
    assert sink.events == [("line", "stderr", "ranks 0-1", C10D.format(s=1, ns=5))]


def test_a_display_ends_a_part_so_lines_and_displays_keep_their_order():
    sink = ListSink()
    merger = OutputMerger([0, 1], sink, clock=FakeClock())
    for rank in (0, 1):
        merger.feed(rank, "stdout", "before\n")
    for rank in (0, 1):
        merger.feed_display(rank, {"image/png": "AAAA"})
    for rank in (0, 1):
        merger.feed(rank, "stdout", "after\n")
    merger.close()
    assert sink.folds == [
        [("stdout", "ranks 0-1", "before")],
        [("stdout", "ranks 0-1", "after")],
    ]
    assert merger.rank_output(1) == "before\nafter\n"


def test_the_live_fold_is_redrawn_at_most_every_interval_and_only_when_changed():
    class Recorder(ListSink):
        def __init__(self):
            super().__init__()
            self.live = []

        def fold(self, lines, final):
            if not final:
                self.live.append(folded(lines))
            super().fold(lines, final)

    sink, clock = Recorder(), FakeClock()
    merger = OutputMerger([0, 1], sink, clock=clock)
    merger.feed(0, "stdout", "a\n")
    merger.feed(1, "stdout", "a\n")
    merger.poll()
    assert sink.live == []  # a short cell shows only its final fold
    clock.now += LIVE_FOLD_AFTER_S
    merger.poll()
    merger.feed(0, "stdout", "b\n")
    merger.feed(1, "stdout", "b\n")
    merger.poll()  # too soon after the first redraw
    clock.now += LIVE_FOLD_S
    merger.poll()
    merger.poll()  # nothing new
    assert sink.live == [["[ranks 0-1] a"], ["[ranks 0-1] a", "[ranks 0-1] b"]]


def test_nbdist_output_reads_one_ranks_whole_output_of_the_latest_cell(monkeypatch):
    monkeypatch.setattr(cell_output, "_latest", None)
    with pytest.raises(NbdistError, match="no cell has run"):
        cell_output.output(0)
    merger = OutputMerger([0, 1], ListSink(), clock=FakeClock(), per_rank=2)
    for i in range(5):
        merger.feed(1, "stdout", f"line {i}\n")
    merger.feed(1, "stderr", C10D.format(s=3, ns=3) + "\n")
    merger.close()
    cell_output.remember(merger)
    text = cell_output.output(rank=1)
    assert text == "".join(f"line {i}\n" for i in range(5)) + C10D.format(s=3, ns=3) + "\n"
    assert cell_output.output(1, "stderr") == C10D.format(s=3, ns=3) + "\n"
    with pytest.raises(ValueError, match="rank 5 did not run the latest cell"):
        cell_output.output(5)
    with pytest.raises(ValueError, match="stream"):
        cell_output.output(0, "stdin")


# -- KernelSink -----------------------------------------------------------------------------


class _Handle:
    def __init__(self, log, data):
        self.log = log
        log.append(("display", data))

    def update(self, data, raw=False):
        self.log.append(("update", data))


def test_kernel_sink_draws_the_live_fold_in_place_then_writes_the_final_fold(monkeypatch, capsys):
    ipython_display = pytest.importorskip("IPython.display")
    log = []
    monkeypatch.setattr(
        ipython_display, "display", lambda data, raw=False, display_id=None: _Handle(log, data)
    )
    sink = KernelSink(n_ranks=4)
    sink.line("stdout", "ranks 0-1", "epoch 0 done")  # the fold shows it, not the line
    sink.fold([("stdout", "ranks 0-1", "epoch 0 done")], final=False)
    sink.fold([("stdout", "ranks 0-3", "epoch 0 done")], final=False)
    sink.fold([("stdout", "ranks 0-3", "epoch 0 done"), ("stderr", "rank 2", "warn")], final=True)
    assert log == [
        ("display", {"text/plain": "[ranks 0-1] epoch 0 done"}),
        ("update", {"text/plain": "[ranks 0-3] epoch 0 done"}),
        ("update", {"text/plain": ""}),
    ]
    captured = capsys.readouterr()
    assert captured.out == "[ranks 0-3] epoch 0 done\n"
    assert captured.err == "[rank 2] warn\n"


def test_kernel_sink_of_one_rank_writes_lines_as_they_come(capsys):
    sink = KernelSink(n_ranks=1)
    sink.line("stdout", "rank 0", "now")
    sink.fold([("stdout", "rank 0", "now")], final=True)
    assert capsys.readouterr().out == "[rank 0] now\n"
