"""Unit tests for nbdist.driver.output: per-rank output merging and the sinks."""

from __future__ import annotations

import io
import sys

import pytest

from nbdist.driver.output import OutputMerger
from nbdist.driver.sinks import KernelSink, ListSink, StreamSink, default_sink
from nbdist.errors import format_ranks


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_merger(ranks, *, window=0.15):
    sink = ListSink()
    clock = FakeClock()
    merger = OutputMerger(ranks, sink, window=window, clock=clock)
    return merger, sink, clock


def lines(sink, stream="stdout"):
    """The (label, text) of the line events of ``stream``, in order."""
    return [(e[2], e[3]) for e in sink.events if e[0] == "line" and e[1] == stream]


# -- format_ranks ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([0, 1, 2, 3], "ranks 0-3"),
        ([2], "rank 2"),
        ([0, 2, 3, 5], "ranks 0,2-3,5"),
        ([5, 3, 2, 2, 0], "ranks 0,2-3,5"),
        ([1, 3], "ranks 1,3"),
        ([0, 1], "ranks 0-1"),
        ([7, 7], "rank 7"),
        (range(8), "ranks 0-7"),
        ([0, 1, 2, 4, 6, 7], "ranks 0-2,4,6-7"),
    ],
)
def test_format_ranks(ranks, expected):
    assert format_ranks(ranks) == expected


def test_format_ranks_rejects_empty():
    with pytest.raises(ValueError):
        format_ranks([])


# -- grouping -------------------------------------------------------------------


def test_identical_lines_from_all_ranks_are_shown_once():
    merger, sink, _ = make_merger([0, 1, 2, 3])
    for rank in (2, 0, 3):
        merger.feed(rank, "stdout", "hello\n")
    assert sink.events == []  # rank 1 may still print the same line
    merger.feed(1, "stdout", "hello\n")
    assert sink.events == [("line", "stdout", "ranks 0-3", "hello")]


def test_different_lines_are_shown_per_rank_in_rank_order():
    merger, sink, _ = make_merger([0, 1, 2, 3])
    for rank in (3, 1, 0, 2):
        merger.feed(rank, "stdout", f"loss {rank}\n")
    assert sink.events == [
        ("line", "stdout", "rank 0", "loss 0"),
        ("line", "stdout", "rank 1", "loss 1"),
        ("line", "stdout", "rank 2", "loss 2"),
        ("line", "stdout", "rank 3", "loss 3"),
    ]


def test_groups_are_ordered_by_lowest_rank():
    merger, sink, _ = make_merger([0, 1, 2, 3])
    merger.feed(1, "stdout", "odd\n")
    merger.feed(3, "stdout", "odd\n")
    merger.feed(2, "stdout", "even\n")
    merger.feed(0, "stdout", "even\n")
    assert lines(sink) == [("ranks 0,2", "even"), ("ranks 1,3", "odd")]


def test_several_lines_per_chunk_group_position_by_position():
    merger, sink, _ = make_merger([0, 1])
    merger.feed(0, "stdout", "epoch 1\nloss 0.5\nacc 0.9\n")
    merger.feed(1, "stdout", "epoch 1\nloss 0.7\n")
    assert lines(sink) == [
        ("ranks 0-1", "epoch 1"),
        ("rank 0", "loss 0.5"),
        ("rank 1", "loss 0.7"),
    ]
    merger.feed(1, "stdout", "acc 0.9\n")
    assert lines(sink)[-1] == ("ranks 0-1", "acc 0.9")


def test_streams_are_grouped_separately_and_keep_their_stream():
    merger, sink, _ = make_merger([0, 1])
    merger.feed(0, "stderr", "warning\n")
    merger.feed(0, "stdout", "result\n")
    merger.feed(1, "stdout", "result\n")
    merger.feed(1, "stderr", "warning\n")
    assert sink.events == [
        ("line", "stdout", "ranks 0-1", "result"),
        ("line", "stderr", "ranks 0-1", "warning"),
    ]


def test_partial_line_chunks_are_reassembled():
    merger, sink, _ = make_merger([0, 1])
    for chunk in ("hel", "lo wo", "rld\nsec"):
        merger.feed(0, "stdout", chunk)
    merger.feed(1, "stdout", "hello")
    merger.feed(1, "stdout", " world\n")
    assert sink.events == [("line", "stdout", "ranks 0-1", "hello world")]
    merger.feed(0, "stdout", "ond\n")
    merger.feed(1, "stdout", "second\n")
    assert lines(sink) == [("ranks 0-1", "hello world"), ("ranks 0-1", "second")]


def test_empty_lines_are_lines():
    merger, sink, _ = make_merger([0])
    merger.feed(0, "stdout", "\n\nx\n")
    assert lines(sink) == [("rank 0", ""), ("rank 0", ""), ("rank 0", "x")]


def test_single_rank_emits_immediately():
    merger, sink, _ = make_merger([5], window=60.0)
    merger.feed(5, "stdout", "now\n")
    assert sink.events == [("line", "stdout", "rank 5", "now")]


# -- the window -------------------------------------------------------------------


def test_silent_rank_delays_others_at_most_the_window():
    merger, sink, clock = make_merger([0, 1, 2, 3], window=0.15)
    merger.feed(0, "stdout", "only rank 0\n")
    clock.advance(0.1)
    merger.poll()
    assert sink.events == []
    clock.advance(0.05)
    merger.poll()
    assert sink.events == [("line", "stdout", "rank 0", "only rank 0")]


def test_lines_are_checked_for_age_individually():
    merger, sink, clock = make_merger([0, 1], window=0.15)
    merger.feed(0, "stdout", "first\n")
    clock.advance(0.1)
    merger.feed(0, "stdout", "second\n")
    clock.advance(0.06)
    merger.poll()
    assert lines(sink) == [("rank 0", "first")]
    clock.advance(0.1)
    merger.poll()
    assert lines(sink) == [("rank 0", "first"), ("rank 0", "second")]


def test_identical_overdue_lines_of_a_subset_are_grouped():
    merger, sink, clock = make_merger([0, 1, 2, 3], window=0.15)
    for rank in (0, 1, 2):
        merger.feed(rank, "stdout", "step 1\n")
    clock.advance(0.2)
    merger.poll()
    assert lines(sink) == [("ranks 0-2", "step 1")]
    merger.feed(3, "stdout", "step 1\n")  # the straggler, after the others went out
    clock.advance(0.2)
    merger.poll()
    assert lines(sink) == [("ranks 0-2", "step 1"), ("rank 3", "step 1")]


def test_feed_also_flushes_overdue_lines_without_poll():
    merger, sink, clock = make_merger([0, 1], window=0.15)
    merger.feed(0, "stdout", "old\n")
    clock.advance(1.0)
    merger.feed(0, "stdout", "new\n")
    assert lines(sink) == [("rank 0", "old")]


def test_order_within_each_rank_is_preserved():
    merger, sink, clock = make_merger([0, 1, 2], window=0.15)
    expected = {rank: [f"r{rank} line {i}" for i in range(6)] for rank in (0, 1, 2)}
    # Ranks advance at different paces, some lines coincide, some go out alone.
    schedule = [(0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1), (0, 3), (0, 4), (2, 1)]
    schedule += [(1, 2), (1, 3), (2, 2), (0, 5), (2, 3), (1, 4), (2, 4), (1, 5), (2, 5)]
    for rank, i in schedule:
        merger.feed(rank, "stdout", expected[rank][i] + "\n")
        clock.advance(0.07)
        merger.poll()
    merger.close()
    seen = {rank: [] for rank in (0, 1, 2)}
    for label, text in lines(sink):
        assert label.startswith("rank ")
        seen[int(label.split()[1])].append(text)
    assert seen == expected


# -- carriage returns / progress bars -----------------------------------------------


def test_progress_updates_then_one_final_grouped_line():
    merger, sink, _ = make_merger([0, 1])
    merger.feed(0, "stderr", "\r  0%|   |")
    merger.poll()
    merger.feed(0, "stderr", "\r 50%|#  |\r100%|###|")
    merger.feed(1, "stderr", "\r100%|###|")
    merger.poll()
    merger.poll()  # nothing changed: no repeated update
    merger.feed(0, "stderr", "\n")
    merger.feed(1, "stderr", "\n")
    assert sink.events == [
        ("progress", "stderr", "rank 0", "  0%|   |"),
        ("progress", "stderr", "rank 0", "100%|###|"),
        ("progress", "stderr", "rank 1", "100%|###|"),
        ("progress_done", "stderr", "rank 0"),
        ("progress_done", "stderr", "rank 1"),
        ("line", "stderr", "ranks 0-1", "100%|###|"),
    ]


def test_progress_is_reported_at_most_once_per_poll():
    merger, sink, _ = make_merger([0])
    for i in range(100):
        merger.feed(0, "stderr", f"\rstep {i}")
    assert sink.events == []
    merger.poll()
    assert sink.events == [("progress", "stderr", "rank 0", "step 99")]


def test_unchanged_progress_redraw_is_not_reported_again():
    merger, sink, _ = make_merger([0])
    merger.feed(0, "stderr", "\r 50%")
    merger.poll()
    merger.feed(0, "stderr", "\r 50%")
    merger.poll()
    assert sink.events == [("progress", "stderr", "rank 0", " 50%")]


def test_trailing_carriage_return_keeps_the_text_visible():
    merger, sink, _ = make_merger([0])
    merger.feed(0, "stderr", "50%...\r")
    merger.poll()
    merger.feed(0, "stderr", "\n")
    assert sink.events == [
        ("progress", "stderr", "rank 0", "50%..."),
        ("progress_done", "stderr", "rank 0"),
        ("line", "stderr", "rank 0", "50%..."),
    ]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("a\rb\n", "b"), ("crlf\r\n", "crlf"), ("x\r\ry\r\n", "y"), ("plain\n", "plain")],
)
def test_completed_line_shows_text_after_last_carriage_return(raw, expected):
    merger, sink, _ = make_merger([0])
    merger.feed(0, "stdout", raw)
    assert sink.events == [("line", "stdout", "rank 0", expected)]


def test_long_progress_line_does_not_accumulate():
    merger, sink, _ = make_merger([0])
    for i in range(10_000):
        merger.feed(0, "stderr", f"\r{i:>6}/10000 " + "#" * 40)
    assert len(merger._lines[(0, "stderr")].tail) < 60
    merger.feed(0, "stderr", "\n")
    assert lines(sink, "stderr") == [("rank 0", "  9999/10000 " + "#" * 40)]


def test_real_tqdm_bar_gives_progress_and_one_final_line_per_rank():
    tqdm = pytest.importorskip("tqdm").tqdm
    merger, sink, _ = make_merger([0, 1])

    class RankFile:
        def __init__(self, rank):
            self.rank = rank

        def write(self, text):
            merger.feed(self.rank, "stderr", text)

        def flush(self):
            merger.poll()

    for rank in (0, 1):
        bar_format = "{desc}{n}/{total}"
        for _ in tqdm(
            range(3), file=RankFile(rank), mininterval=0, desc=f"r{rank} ", bar_format=bar_format
        ):
            pass
    assert lines(sink, "stderr") == [("rank 0", "r0 3/3"), ("rank 1", "r1 3/3")]
    progress = [e for e in sink.events if e[0] == "progress"]
    assert progress[0] == ("progress", "stderr", "rank 0", "r0 0/3")
    assert {e[2] for e in progress} == {"rank 0", "rank 1"}


# -- close ----------------------------------------------------------------------------


def test_close_flushes_unterminated_tails_grouped():
    merger, sink, _ = make_merger([0, 1, 2])
    merger.feed(0, "stdout", "no newline")
    merger.feed(1, "stdout", "no newline")
    merger.feed(2, "stdout", "other")
    assert sink.events == []
    merger.close()
    assert sink.events == [
        ("line", "stdout", "ranks 0-1", "no newline"),
        ("line", "stdout", "rank 2", "other"),
    ]


def test_close_groups_queued_lines_position_by_position_then_tails():
    merger, sink, _ = make_merger([0, 1, 2], window=10.0)
    merger.feed(0, "stdout", "a\nb\ntail")
    merger.feed(1, "stdout", "a\nc\n")
    merger.close()
    assert lines(sink) == [
        ("ranks 0-1", "a"),
        ("rank 0", "b"),
        ("rank 1", "c"),
        ("rank 0", "tail"),
    ]


def test_close_ends_a_running_progress_bar_with_its_last_state():
    merger, sink, _ = make_merger([0, 1])
    merger.feed(1, "stderr", "\r 40%|##   |")
    merger.poll()
    merger.close()
    assert sink.events == [
        ("progress", "stderr", "rank 1", " 40%|##   |"),
        ("progress_done", "stderr", "rank 1"),
        ("line", "stderr", "rank 1", " 40%|##   |"),
    ]


def test_close_drops_an_erased_progress_bar():
    merger, sink, _ = make_merger([0])
    merger.feed(0, "stderr", "\r 40%|##   |\r            \r")
    merger.close()
    assert sink.events == []


def test_merger_is_empty_after_close():
    merger, sink, clock = make_merger([0, 1])
    merger.feed(0, "stdout", "x")
    merger.close()
    merger.close()
    clock.advance(5)
    merger.poll()
    assert sink.events == [("line", "stdout", "rank 0", "x")]


# -- displays --------------------------------------------------------------------


def test_identical_displays_are_shown_once():
    merger, sink, _ = make_merger([0, 1, 2])
    for rank in (0, 1, 2):
        merger.feed_display(rank, {"text/plain": "<Figure>", "image/png": "AAAA"})
    assert sink.events == [
        ("display", "ranks 0-2", {"text/plain": "<Figure>", "image/png": "AAAA"}, {}),
    ]


def test_different_displays_are_shown_per_group():
    merger, sink, _ = make_merger([0, 1, 2])
    merger.feed_display(2, {"text/plain": "b"}, {"k": 2})
    merger.feed_display(0, {"text/plain": "a"}, {"k": 0})
    merger.feed_display(1, {"text/plain": "b"}, {"k": 1})
    assert sink.events == [
        ("display", "rank 0", {"text/plain": "a"}, {"k": 0}),
        ("display", "ranks 1-2", {"text/plain": "b"}, {"k": 1}),
    ]


def test_display_of_one_rank_waits_only_the_window():
    merger, sink, clock = make_merger([0, 1])
    merger.feed_display(1, {"text/plain": "only 1"})
    merger.poll()
    assert sink.events == []
    clock.advance(0.2)
    merger.poll()
    assert sink.events == [("display", "rank 1", {"text/plain": "only 1"}, {})]


def test_a_line_one_rank_printed_comes_before_the_cells_value():
    """``if rank == 0: print(loss)`` and then the cell's value on every rank: rank 0's line
    waits for the other ranks to fold it, but it came first and is shown first, as in a
    kernel of its own (it was shown after the values)."""
    merger, sink, clock = make_merger([0, 1])
    merger.feed(0, "stdout", "loss 0.5\n")
    clock.advance(0.05)  # within the window: the line still waits for rank 1
    merger.end_lines()  # the cell ended on every rank
    merger.feed_display(0, {"text/plain": "10"})
    merger.feed_display(1, {"text/plain": "10"})
    assert sink.events == [
        ("line", "stdout", "rank 0", "loss 0.5"),
        ("display", "ranks 0-1", {"text/plain": "10"}, {}),
    ]


def test_a_line_read_before_a_display_it_followed_still_folds_with_other_ranks():
    """A rank's streams and displays are read separately: under load, a rank's display and
    the line it printed after it come in one read, the line first. A display mid-cell does
    not let out the lines waiting for other ranks, so that line still folds with theirs
    (it was split into one line per rank, CI 2026-12-03)."""
    merger, sink, clock = make_merger([0, 1])
    merger.feed_display(0, {"text/html": "<b>hi</b>"})
    merger.feed(1, "stderr", "done 3/3\n")  # rank 1's read: its line, then its display
    merger.feed_display(1, {"text/html": "<b>hi</b>"})
    clock.advance(0.05)
    merger.feed(0, "stderr", "done 3/3\n")
    merger.close()
    assert sink.events == [
        ("display", "ranks 0-1", {"text/html": "<b>hi</b>"}, {}),
        ("line", "stderr", "ranks 0-1", "done 3/3"),
    ]


def test_a_display_does_not_take_the_lines_of_ranks_it_does_not_show():
    """Only the displayed ranks' waiting lines go out before it: another rank's line, which
    came after the display was fed, keeps waiting for its group."""
    merger, sink, clock = make_merger([0, 1, 2])
    merger.feed_display(0, {"text/plain": "x"})
    merger.feed_display(1, {"text/plain": "x"})
    clock.advance(0.1)
    merger.feed(2, "stdout", "step 1\n")
    clock.advance(0.06)  # the display is past the window, rank 2's line is not
    merger.poll()
    assert sink.events == [("display", "ranks 0-1", {"text/plain": "x"}, {})]
    for rank in (0, 1):
        merger.feed(rank, "stdout", "step 1\n")
    assert sink.events[1:] == [("line", "stdout", "ranks 0-2", "step 1")]


def test_end_lines_puts_an_unterminated_last_line_before_what_follows():
    """``print('a', end='')`` and then the cell's value: the line ends before the value."""
    merger, sink, _clock = make_merger([0, 1])
    for rank in (0, 1):
        merger.feed(rank, "stdout", "a")
    merger.end_lines()
    for rank in (0, 1):
        merger.feed_display(rank, {"text/plain": "5"})
    merger.close()
    assert sink.events == [
        ("line", "stdout", "ranks 0-1", "a"),
        ("display", "ranks 0-1", {"text/plain": "5"}, {}),
    ]


# -- validation -----------------------------------------------------------------------


def test_rejects_unknown_rank_and_stream():
    merger, _, _ = make_merger([0, 1])
    with pytest.raises(ValueError, match="rank 7"):
        merger.feed(7, "stdout", "x\n")
    with pytest.raises(ValueError, match="stream"):
        merger.feed(0, "stdin", "x\n")
    with pytest.raises(ValueError):
        merger.feed_display(2, {"text/plain": "x"})
    with pytest.raises(ValueError):
        OutputMerger([], ListSink())


# -- StreamSink ---------------------------------------------------------------------------


def test_stream_sink_writes_labelled_lines_to_their_stream(capsys):
    sink = StreamSink()
    sink.line("stdout", "ranks 0-3", "hello")
    sink.line("stderr", "rank 1", "oops")
    sink.progress("stderr", "rank 1", " 50%")  # not a tty: ignored
    sink.display("rank 2", {"text/plain": "two\nlines", "image/png": "AAAA"}, {})
    sink.display("rank 3", {"image/png": "AAAA"}, {})
    captured = capsys.readouterr()
    assert (
        captured.out
        == "[ranks 0-3] hello\n[rank 2] two\n[rank 2] lines\n[rank 3] <display: image/png>\n"
    )
    assert captured.err == "[rank 1] oops\n"


def test_stream_sink_behind_a_merger(capsys):
    sink = StreamSink()
    merger = OutputMerger([0, 1], sink, clock=FakeClock())
    merger.feed(0, "stdout", "same\n")
    merger.feed(1, "stdout", "same\n")
    merger.feed(1, "stderr", "\rbar 3/3\n")
    merger.close()
    captured = capsys.readouterr()
    assert captured.out == "[ranks 0-1] same\n"
    assert captured.err == "[rank 1] bar 3/3\n"


def test_stream_sink_writes_the_lines_of_one_pass_at_once(monkeypatch):
    # 256 ranks' lines flushed one by one cost a system call each on a terminal.
    class Counting(io.StringIO):
        flushes = 0

        def flush(self):
            self.flushes += 1

    out = Counting()
    monkeypatch.setattr(sys, "stdout", out)
    merger = OutputMerger(range(4), StreamSink(), clock=FakeClock())
    for rank in range(4):
        merger.feed(rank, "stdout", f"rank {rank} says {rank * 11}\n")
    assert out.getvalue() == "".join(f"[rank {r}] rank {r} says {r * 11}\n" for r in range(4))
    assert out.flushes == 1


def test_stream_sink_looks_streams_up_at_write_time(monkeypatch):
    sink = StreamSink()
    replacement = io.StringIO()
    monkeypatch.setattr(sys, "stdout", replacement)
    sink.line("stdout", "rank 0", "captured")
    assert replacement.getvalue() == "[rank 0] captured\n"


class _TtyBuffer(io.StringIO):
    def isatty(self):
        return True


def test_stream_sink_draws_progress_in_place_on_a_tty(monkeypatch):
    terminal = _TtyBuffer()
    monkeypatch.setattr(sys, "stderr", terminal)
    sink = StreamSink()
    sink.progress("stderr", "rank 0", " 10%")
    sink.progress("stderr", "rank 0", " 90%")
    sink.progress_done("stderr", "rank 0")
    sink.line("stderr", "rank 0", "100%")
    assert (
        terminal.getvalue() == "\r\x1b[K[rank 0]  10%\r\x1b[K[rank 0]  90%\r\x1b[K[rank 0] 100%\n"
    )


# -- KernelSink / default_sink ---------------------------------------------------------------


class _FakeHandle:
    def __init__(self, log, data):
        self.log = log
        log.append(("display", data))

    def update(self, data, raw=False):
        assert raw
        self.log.append(("update", data))


def _fake_displays(monkeypatch) -> list:
    ipython_display = pytest.importorskip("IPython.display")
    log = []

    def fake_display(data, raw=False, display_id=None):
        assert raw and display_id is True
        return _FakeHandle(log, data)

    monkeypatch.setattr(ipython_display, "display", fake_display)
    return log


def test_kernel_sink_of_one_rank_keeps_one_display_per_progress_bar(monkeypatch):
    log = _fake_displays(monkeypatch)
    sink = KernelSink(n_ranks=1)
    sink.progress("stderr", "rank 0", "10%")
    sink.progress("stderr", "rank 0", "90%")
    sink.progress_done("stderr", "rank 0")
    sink.progress("stderr", "rank 0", "new bar")
    assert log == [
        ("display", {"text/plain": "[rank 0] 10%"}),
        ("update", {"text/plain": "[rank 0] 90%"}),
        ("update", {"text/plain": ""}),
        ("display", {"text/plain": "[rank 0] new bar"}),
    ]


def test_kernel_sink_draws_several_ranks_bars_in_one_display(monkeypatch):
    # One display per rank left as many blank outputs in the saved notebook; it is
    # redrawn once per pass of the merger (progress_flush), not once per rank.
    log = _fake_displays(monkeypatch)
    sink = KernelSink(n_ranks=2)
    sink.progress("stderr", "rank 0", "10%")
    sink.progress_flush()
    sink.progress("stderr", "rank 1", "10%")
    sink.progress_flush()
    sink.progress("stderr", "rank 0", "90%")
    sink.progress_flush()
    sink.progress_flush()  # nothing moved: nothing drawn
    sink.progress_done("stderr", "rank 0")
    sink.progress_flush()
    sink.progress_done("stderr", "rank 1")
    sink.progress("stderr", "rank 0", "new bar")
    sink.progress_flush()
    sink.progress_done("stderr", "rank 0")
    sink.progress_flush()
    assert log == [
        ("display", {"text/plain": "[rank 0] 10%"}),
        ("update", {"text/plain": "[ranks 0-1] 10%"}),
        ("update", {"text/plain": "[rank 0] 90%\n[rank 1] 10%"}),
        ("update", {"text/plain": "[rank 1] 10%"}),
        ("update", {"text/plain": "[rank 0] new bar"}),
        ("update", {"text/plain": ""}),
    ]


def test_the_bars_of_256_ranks_are_a_few_lines():
    from nbdist.driver.sinks import BARS_SHOWN, bar_lines

    bars = {(f"rank {r}", "stderr"): f"{r % 4 * 25}%" for r in range(200)}
    bars.update({(f"rank {r}", "stderr"): f"{r}/256" for r in range(200, 256)})
    lines = bar_lines(bars).splitlines()
    assert lines[0] == "[ranks " + ",".join(str(r) for r in range(0, 200, 4)) + "] 0%"
    assert lines[1].startswith("[ranks 1,5,") and lines[1].endswith("] 25%")
    assert lines[BARS_SHOWN - 1] == "[rank 203] 203/256"
    assert lines[BARS_SHOWN:] == ["... and 52 more ranks' bars"]


@pytest.mark.parametrize(("n_ranks", "expected_out"), [(2, "[ranks 0-1]\n"), (1, "")])
def test_kernel_sink_republishes_displays(monkeypatch, capsys, n_ranks, expected_out):
    ipython_display = pytest.importorskip("IPython.display")
    published = []
    monkeypatch.setattr(
        ipython_display,
        "publish_display_data",
        lambda data, metadata=None: published.append((data, metadata)),
    )
    KernelSink(n_ranks=n_ranks).display("ranks 0-1", {"image/png": "AAAA"}, {"w": 1})
    assert capsys.readouterr().out == expected_out
    assert published == [({"image/png": "AAAA"}, {"w": 1})]


def test_a_sink_that_shows_only_the_fold_gets_every_line_folded_and_none_by_arrival():
    # A notebook cell of several ranks (KernelSink) draws its lines from the fold only:
    # the merger no longer groups each line by arrival for a sink that would drop it.
    class FoldOnly(ListSink):
        wants_lines = False

    sink, clock = FoldOnly(), FakeClock()
    merger = OutputMerger([0, 1, 2], sink, clock=clock)
    for rank in (0, 1, 2):
        merger.feed(rank, "stdout", f"loss 0.5\nrank {rank} own\n")
    clock.advance(1.0)
    merger.poll()
    merger.close()
    assert lines(sink) == []
    assert sink.folds == [
        [
            ("stdout", "ranks 0-2", "loss 0.5"),
            ("stdout", "rank 0", "rank 0 own"),
            ("stdout", "rank 1", "rank 1 own"),
            ("stdout", "rank 2", "rank 2 own"),
        ]
    ]
    assert KernelSink(n_ranks=2).wants_lines is False
    assert KernelSink(n_ranks=1).wants_lines is True


def test_default_sink_outside_a_kernel_is_a_stream_sink():
    sink = default_sink(4)
    assert type(sink) is StreamSink


def test_default_sink_inside_a_kernel_is_a_kernel_sink(monkeypatch):
    ipython = pytest.importorskip("IPython")

    class FakeShell:
        kernel = object()

    monkeypatch.setattr(ipython, "get_ipython", lambda: FakeShell())
    assert type(default_sink(4)) is KernelSink


def test_torch_profiler_start_stop_lines_are_left_out_of_the_cell():
    # torch 2.13's profiler prints these on every rank's stderr at each start and stop.
    merger, sink, _ = make_merger([0, 1])
    for r in (0, 1):
        merger.feed(
            r,
            "stderr",
            f"USDT:2026-11-30 16:11:00 1576{r}:1576{r} SyncActivityProfilerHandler.cpp:52]"
            " profiler_start\n",
        )
        merger.feed(r, "stderr", "a real warning\n")
        merger.feed(
            r,
            "stderr",
            f"USDT:2026-11-30 16:11:01 1576{r}:1576{r} SyncActivityProfilerHandler.cpp:59]"
            " profiler_stop\n",
        )
    merger.feed(0, "stdout", "USDT: profiler_start is only filtered on stderr\n")
    merger.close()
    assert lines(sink, "stderr") == [("ranks 0-1", "a real warning")]
    assert lines(sink, "stdout") == [("rank 0", "USDT: profiler_start is only filtered on stderr")]
