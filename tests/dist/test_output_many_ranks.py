"""Many ranks' output through real engines (32 CPU ranks): folded by content, whatever the timing.

32 ranks start in a few seconds here; one session serves the module.
"""

from __future__ import annotations

import time

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status

RANKS = 32


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(RANKS, cpu=True, threads=1, timeout=300) as s:
        yield s


def test_lines_every_rank_prints_fold_to_one_each_when_the_cell_ends(session):
    sink = ListSink()
    session.run(
        "import time\nfor e in range(3):\n    time.sleep(0.2)\n    print('epoch', e, 'done')",
        sink=sink,
    )
    assert sink.folds == [[("stdout", f"ranks 0-{RANKS - 1}", f"epoch {e} done") for e in range(3)]]


def test_a_rank_over_the_line_limit_keeps_its_tail_and_nbdist_output_has_the_rest(
    session, monkeypatch
):
    monkeypatch.setenv("NBDIST_OUTPUT_LINES", "20")
    sink = ListSink()
    session.run("if rank == 3:\n    for i in range(100):\n        print('line', i)", sink=sink)
    [fold] = sink.folds
    assert fold[0] == (
        "stdout",
        "rank 3",
        "… 80 earlier lines not shown (the last 20 of each rank are); "
        "nbdist.output(rank=3) has all of a rank's output",
    )
    assert fold[1:] == [("stdout", "rank 3", f"line {i}") for i in range(80, 100)]
    assert nbdist.output(rank=3) == "".join(f"line {i}\n" for i in range(100))
    assert nbdist.output(rank=4) == ""


def test_status_lists_only_the_straggler_and_names_it(session):
    session.run(
        "import time\nfor step in range(15):\n"
        "    time.sleep(0.12 if rank == 7 else 0.03)\n"
        "    nbdist.log(step=step, loss=1.0 / (step + 1))",
        sink=ListSink(),
    )
    deadline = time.monotonic() + 30
    while session.metrics.count() < RANKS * 15 and time.monotonic() < deadline:
        time.sleep(0.1)  # the last points are still on their way from the ranks

    text = format_status(session.status())
    assert f"{RANKS} ranks on " in text.splitlines()[0]
    assert "1 rank deviating" in text, text
    assert "rank 7 is a straggler: " in text, text
