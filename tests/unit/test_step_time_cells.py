"""The dashboard table's step time cell reads in µs below a millisecond, never "0.0 ms".

What a user sees: the table rows' text cells as the widget gets them (model.table).
"""

from __future__ import annotations

import pytest

from nbdist.dashboard.model import DashboardModel
from nbdist.dashboard.table import fmt_seconds
from nbdist.metrics.run import Run

T0 = 1_700_000_000.0


@pytest.mark.parametrize(
    ("seconds", "cell"),
    [(0.00004, "40 µs"), (0.0000025, "2.5 µs"), (0.000999, "999 µs"), (0.0009999, "1.0 ms")],
)
def test_a_step_under_a_millisecond_shows_in_microseconds(seconds, cell):
    run = Run(1, world_size=1, started=T0)
    run.add(0, [(s, T0 + s, {"loss": 1.0, "step_time": seconds}) for s in range(5)])
    model = DashboardModel(run, clock=lambda: T0 + 200.0)
    model.poll()
    table = model.table
    column = table["headers"].index("step time")
    assert table["rows"][0]["cells"][column] == cell


def test_longer_steps_keep_milliseconds_and_seconds():
    assert [fmt_seconds(v) for v in (0.0123, 0.5, 1.25, None)] == [
        "12.3 ms",
        "500.0 ms",
        "1.25 s",
        "–",
    ]
