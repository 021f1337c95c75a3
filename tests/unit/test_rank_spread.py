"""The median and min-max band across ranks (nbdist.server.rank_summary.spread), as the
past-run view of many ranks and the sidebar's median line draw it."""

from __future__ import annotations

import numpy as np

from nbdist.server.rank_summary import median_series, spread


def test_a_step_logged_again_after_a_restart_counts_its_last_value_and_later_steps_stay():
    # Three ranks ran steps 0-9, were restarted and ran 0-19: every step is every rank's.
    xs = [list(range(10)) + list(range(20)) for _ in range(3)]
    ys = [[100.0] * 10 + [float(r + s) for s in range(20)] for r in range(3)]
    at, median, low, high = spread(xs, ys)
    assert at.tolist() == list(range(20))  # not only the steps logged twice
    assert median.tolist() == [1.0 + s for s in range(20)]  # the later values, not 100
    assert low.tolist() == [float(s) for s in range(20)]
    assert high.tolist() == [2.0 + s for s in range(20)]


def test_a_step_only_a_few_ranks_reached_is_no_median_yet():
    xs = [[0, 1], [0], [0], [0]]
    ys = [[1.0, 7.0], [2.0], [3.0], [4.0]]
    assert median_series([[[x, y] for x, y in zip(a, b)] for a, b in zip(xs, ys)]) == [[0.0, 2.5]]


def test_time_bins_keep_a_slower_stretch_and_sit_in_the_middle_of_their_bin():
    # Two ranks logging 10 times a second for 10 s, then 3 times a second for 10 s.
    times = np.concatenate([np.arange(0, 10, 0.1), np.arange(10, 20, 1 / 3)])
    xs = [times, times + 0.05]
    ys = [np.full(times.size, 1.0), np.full(times.size, 3.0)]
    at, median, low, high = spread(xs, ys, bin_width=1.0)
    assert at.tolist() == [b + 0.5 for b in range(20)]  # the slow half is there too
    assert median.tolist() == [2.0] * 20 and low.tolist() == [1.0] * 20
    assert high.tolist() == [3.0] * 20


def test_nan_values_and_ranks_without_points_are_left_out():
    at, median, _, _ = spread([[0, 1], [], [0, 1]], [[np.nan, 1.0], [], [2.0, 3.0]])
    assert at.tolist() == [0, 1] and median.tolist() == [2.0, 2.0]
