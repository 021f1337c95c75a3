"""What ranks print after their cell ended: split into lines, folded across ranks, bounded.

The pure parts of :mod:`nbdist.driver.late_output`; the real path (engines, a
kernel, ipyparallel's client) is tested in tests/notebooks/test_late_output.py
and tests/dist/test_session.py.
"""

from __future__ import annotations

from nbdist.driver.late_output import LateFold, LateLines, split_lines, unfinished_lines

HEADER = "nbdist: printed by the ranks after they finished this cell\n"


def test_chunks_become_whole_lines_per_rank_and_stream_and_a_progress_line_its_last_state():
    tails: dict = {}
    assert split_lines(tails, 0, "stdout", "ep") == []
    assert split_lines(tails, 1, "stdout", "other\nha") == ["other"]
    assert split_lines(tails, 0, "stderr", "warn\n") == ["warn"]
    assert split_lines(tails, 0, "stdout", "och 1\n 10%\r 50%\r100%\r\n") == ["epoch 1", "100%"]
    assert split_lines(tails, 1, "stdout", "lf\n") == ["half"]
    assert tails == {}


def test_an_unterminated_line_keeps_only_its_end():
    tails: dict = {}
    split_lines(tails, 0, "stdout", "x" * 50_000)
    assert len(tails[(0, "stdout")]) == 10_000


def test_lines_still_being_written_show_their_visible_state_identical_ones_once():
    tails: dict = {}
    split_lines(tails, 1, "stdout", "\r 10%\r 40%")
    split_lines(tails, 0, "stdout", "\r 10%\r 40%")
    split_lines(tails, 2, "stdout", "\r 20%")
    split_lines(tails, 0, "stderr", "loading")
    split_lines(tails, 3, "stdout", "\r 99%\r     \r")  # a bar erased on close
    assert unfinished_lines(tails) == ["[rank 0] loading", "[ranks 0-1]  40%", "[rank 2]  20%"]
    split_lines(tails, 0, "stdout", "\r100%\n")  # ended: a whole line now, not this one's
    assert unfinished_lines(tails) == ["[rank 0] loading", "[rank 1]  40%", "[rank 2]  20%"]
    assert unfinished_lines({}) == []


def test_a_line_every_rank_prints_folds_to_one_whatever_the_order_it_comes_in():
    fold = LateFold()
    # rank 1 is a whole loop behind rank 0, rank 2 in between
    for rank, line in [
        (0, "tick 0"),
        (0, "tick 1"),
        (2, "tick 0"),
        (0, "tick 1"),
        (1, "tick 0"),
        (2, "tick 1"),
        (1, "tick 1"),
        (2, "tick 1"),
        (1, "tick 1"),
    ]:
        fold.add(rank, "stdout", line)
    assert fold.text() == (HEADER + "[ranks 0-2] tick 0\n[ranks 0-2] tick 1\n[ranks 0-2] tick 1\n")


def test_lines_differing_in_a_library_timestamp_fold_and_streams_stay_apart():
    fold = LateFold()
    fold.add(0, "stderr", "[W1128 08:32:42.606441197 socket.cpp:207] slow")
    fold.add(1, "stderr", "[W1128 08:32:43.100000001 socket.cpp:207] slow")
    fold.add(1, "stdout", "[W1128 08:32:43.100000001 socket.cpp:207] slow")
    assert fold.text() == (
        HEADER
        + "[ranks 0-1] [W1128 08:32:42.606441197 socket.cpp:207] slow\n"
        + "[rank 1] [W1128 08:32:43.100000001 socket.cpp:207] slow\n"
    )


def test_a_rank_printing_on_and_on_keeps_the_latest_lines_and_says_how_many_went():
    fold = LateFold(limit=5)
    for i in range(12):
        fold.add(3, "stdout", f"step {i}")
    assert fold.text() == HEADER + "… 7 earlier lines not shown (the latest 5 are)\n" + "".join(
        f"[rank 3] step {i}\n" for i in range(7, 12)
    )
    # What is kept to fold later lines is bounded too: a line let go is not counted on,
    # however many distinct lines the ranks print (a day of "step N" lines).
    fold = LateFold(limit=3)
    for i in range(1000):
        fold.add(0, "stdout", f"step {i}")
        fold.add(1, "stdout", f"step {i}")
    assert len(fold._seen) <= 2 * 3
    assert fold.text().endswith("[ranks 0-1] step 998\n[ranks 0-1] step 999\n")
    # A line still kept folds with its next occurrence on another rank.
    fold = LateFold(limit=3)
    for line in ["same", "x", "same"]:
        fold.add(0, "stdout", line)
    fold.add(1, "stdout", "same")
    fold.add(1, "stdout", "same")
    assert fold.text() == HEADER + "[ranks 0-1] same\n[rank 0] x\n[ranks 0-1] same\n"


def test_a_scripts_lines_since_the_last_take_group_identical_ones_in_first_order():
    lines = LateLines()
    for rank, stream, line in [
        (1, "stdout", "a"),
        (0, "stdout", "a"),
        (0, "stderr", "a"),
        (0, "stdout", "b"),
    ]:
        lines.add(rank, stream, line)
    assert lines.take() == [
        ("stdout", "[ranks 0-1] a\n"),
        ("stderr", "[rank 0] a\n"),
        ("stdout", "[rank 0] b\n"),
    ]
    assert lines.take() == []
