"""Several ranks' tqdm bars as one line: nbdist.driver.progress_bars, and where it is used
(the cell's fold, a script's grouped lines, the live bars, the late output).

The bars are real tqdm text (``tqdm.format_meter``, what ``tqdm`` writes on a rank).
"""

from __future__ import annotations

import pytest

from nbdist.driver.late_output import LateFold, LateLines, unfinished_lines
from nbdist.driver.output import OutputMerger
from nbdist.driver.output_fold import LineFold, fold_key
from nbdist.driver.progress_bars import bar_key, live_bar_lines, merge_bars
from nbdist.driver.sinks import KernelSink, ListSink, bar_lines

tqdm = pytest.importorskip("tqdm").tqdm


def bar(n, total, elapsed, **kwargs):
    """The text tqdm writes for ``n`` of ``total`` after ``elapsed`` seconds."""
    kwargs.setdefault("prefix", "epoch")
    return tqdm.format_meter(n, total, elapsed, **kwargs)


def test_tqdm_bars_of_every_form_are_read_and_other_lines_are_not():
    forms = [
        bar(30, 30, 1.7),
        bar(27, 30, 1.7, postfix="loss=0.5"),
        bar(27, None, 1.7),
        bar(0, 30, 0),
        bar(3, 30, 5, prefix=""),
        bar(3000, 30000, 3700, unit_scale=True, unit="B"),
        bar(3, 30, 5, ascii=True),
        bar(3, 30, 5, prefix="a: b"),
    ]
    for text in forms:
        assert bar_key(text) is not None, text
    for text in ["epoch 3 done", "[1, 2]", "loss [0.5, 0.25]", "x [00:01]", "step 3/5 [warmup]"]:
        assert bar_key(text) is None, text
        assert fold_key(text) == text


def test_bars_at_one_count_fold_whatever_their_timing_and_differ_by_count_or_postfix():
    done = [bar(30, 30, t) for t in (0.6, 1.3, 0.64)]
    assert len({bar_key(t) for t in done}) == 1
    assert len({fold_key(t) for t in done}) == 1
    assert bar_key(bar(29, 30, 1.3)) != bar_key(done[0])
    assert bar_key(bar(30, 30, 1, postfix="loss=1")) != bar_key(bar(30, 30, 1, postfix="loss=2"))
    assert bar_key(bar(30, 30, 1, prefix="train")) != bar_key(done[0])


def test_merged_bars_show_each_timing_as_the_range_the_ranks_span():
    texts = [bar(30, 30, 0.61), bar(30, 30, 1.9), bar(30, 30, 0.64)]
    assert merge_bars(texts) == "epoch: 100%|██████████| 30/30 [00:00–00:01<00:00, 15.79–49.18it/s]"
    slow = [bar(3, 30, 5), bar(3, 30, 1.2)]  # 1.67 s/it and 2.50 it/s: ordered by speed
    assert merge_bars(
        slow
    ) == " 10%|█         | 3/30 [00:01–00:05<00:10–00:45, 1.67s/it–2.50it/s]".replace(
        " 10%", "epoch:  10%", 1
    )
    same = [bar(30, 30, 1.0)] * 3
    assert merge_bars(same) == same[0]
    unknown = [bar(5, None, 1.0), bar(5, None, 2.0)]
    assert merge_bars(unknown) == "epoch: 5it [00:01–00:02, 2.50–5.00it/s]"


def test_the_bars_of_256_ranks_fold_into_one_line_in_the_cell():
    fold = LineFold()
    texts = {rank: bar(20, 20, 0.5 + rank / 100) for rank in range(256)}
    for rank in range(255, -1, -1):  # the lowest rank last: its text must not win alone
        fold.add(rank, "stderr", texts[rank])
    rendered = fold.render()
    assert rendered == [("stderr", "ranks 0-255", merge_bars(list(texts.values())))]
    assert rendered[0][2] == "epoch: 100%|██████████| 20/20 [00:00–00:03<00:00, 6.56–40.00it/s]"
    assert fold.tail(10) == rendered
    # Each rank's own output is still its own bar (nbdist.output(rank=...)).
    assert fold.rank_lines(7) == [texts[7]]


def test_a_script_groups_the_bars_that_arrive_together_into_one_line():
    sink = ListSink()
    merger = OutputMerger(range(4), sink, window=60)  # they wait for each other
    for rank in range(4):
        merger.feed(rank, "stderr", bar(5, 5, 1 + rank) + "\n")
    merger.close()
    assert [e[2:] for e in sink.events if e[0] == "line"] == [
        ("ranks 0-3", "epoch: 100%|██████████| 5/5 [00:01–00:04<00:00, 1.25–5.00it/s]")
    ]


def test_the_live_bars_of_one_loop_are_one_line_at_the_slowest_rank():
    bars = {rank: bar(20 if rank % 64 else 12, 20, 1.0) for rank in range(256)}
    assert live_bar_lines(bars) == [
        (
            list(range(256)),
            "epoch:  60%|██████    | 12–20/20 [00:01<00:00, 12.00–20.00it/s]"
            " · slowest: ranks 0,64,128,192",
        )
    ]
    # More slow ranks than are named: counted.
    many = {rank: bar(19 if rank < 100 else 20, 20, 1.0) for rank in range(256)}
    assert live_bar_lines(many)[0][1].endswith(" · slowest: 100 ranks")
    # Two loops (an epoch bar and a step bar) are two lines.
    two = {0: bar(1, 3, 1, prefix="epoch"), 1: bar(2, 3, 1, prefix="epoch")}
    two |= {2: bar(5, 10, 1, prefix="step"), 3: bar(6, 10, 1, prefix="step")}
    assert [ranks for ranks, _ in live_bar_lines(two)] == [[0, 1], [2, 3]]
    sink_lines = bar_lines({(f"rank {r}", "stderr"): text for r, text in bars.items()})
    assert sink_lines.splitlines() == [f"[ranks 0-255] {live_bar_lines(bars)[0][1]}"]


class _Handle:
    def __init__(self, log, data):
        self.log = log
        log.append(data["text/plain"])

    def update(self, data, raw=False):
        self.log.append(data["text/plain"])


def test_the_bars_of_256_ranks_moving_in_one_pass_are_redrawn_once(monkeypatch):
    ipython_display = pytest.importorskip("IPython.display")
    drawn: list[str] = []
    monkeypatch.setattr(
        ipython_display, "display", lambda data, raw=False, display_id=None: _Handle(drawn, data)
    )
    merger = OutputMerger(range(256), KernelSink(n_ranks=256), window=0)
    for rank in range(256):
        merger.feed(rank, "stderr", "\r" + bar(3, 20, 1.0))
    merger.poll()
    assert drawn == [f"[ranks 0-255] {bar(3, 20, 1.0)}"]
    for rank in range(256):
        merger.feed(rank, "stderr", "\r" + bar(4 + rank % 2, 20, 1.0))
    merger.poll()
    assert len(drawn) == 2 and drawn[1].endswith(" · slowest: 128 ranks")
    merger.close()
    assert drawn[-1] == ""  # the live bars blanked once the loop's final line is written


def test_late_bars_fold_with_their_timings_as_ranges():
    late = LateFold()
    for rank in range(3):
        late.add(rank, "stderr", bar(8, 8, 1 + rank))
    assert late.text().splitlines()[1:] == [
        "[ranks 0-2] epoch: 100%|██████████| 8/8 [00:01–00:03<00:00, 2.67–8.00it/s]"
    ]
    script = LateLines()
    for rank in range(3):
        script.add(rank, "stderr", bar(8, 8, 1 + rank))
    assert script.take() == [
        ("stderr", f"[ranks 0-2] {merge_bars([bar(8, 8, 1), bar(8, 8, 3)])}\n")
    ]
    tails = {(rank, "stderr"): "\r" + bar(rank + 1, 8, 1) for rank in range(3)}
    assert unfinished_lines(tails) == [
        "[ranks 0-2] epoch:  12%|█▎        | 1–3/8 [00:01<00:01–00:07, 1.00–3.00it/s] · slowest: rank 0"
    ]
