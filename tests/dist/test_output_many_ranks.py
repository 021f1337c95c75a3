"""Many ranks' output through real engines (32 CPU ranks): folded by content, whatever the timing.

32 ranks start in a few seconds here; one session serves the module.
"""

from __future__ import annotations

import re
import time

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.driver.status import format_status
from nbdist.errors import RankError

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


def test_an_error_every_rank_meets_at_its_own_time_is_one_line_and_keeps_the_group(session):
    # The ranks meet the same error 1.5 s apart from first to last (as at 256 ranks, where
    # the cell itself reaches them seconds apart): no rank waits for another, so none is
    # interrupted and the group is not formed again; the error reads as one line.
    session.run("sub = dist.new_group(list(range(world_size)))", sink=ListSink())
    with pytest.raises(RankError) as info:
        session.run(
            "import time\ntime.sleep(0.05 * rank)\nraise ValueError('no such column')",
            sink=ListSink(),
        )
    assert info.value.ranks == list(range(RANKS))
    text = str(info.value)
    assert f"ranks 0-{RANKS - 1}: ValueError: no such column" in text, text
    assert "released" not in text, text
    session.run("t = torch.ones(1)\ndist.all_reduce(t, group=sub)\ndel sub", sink=ListSink())
    assert {t.item() for t in session.pull("t")} == {float(RANKS)}


def test_ranks_released_from_one_collective_are_named_in_one_part(session):
    with pytest.raises(RankError) as info:
        session.run(
            "if rank == 5:\n    raise KeyError('bad shard')\ndist.all_reduce(torch.ones(1))",
            sink=ListSink(),
        )
    text = str(info.value)
    # "rank 0 from all_reduce #4, rank 1 from all_reduce #4, ..." for 31 ranks, before.
    assert re.search(
        rf"rank 5 failed; the others were released: ranks 0-4,6-{RANKS - 1} from all_reduce #\d+\.",
        text,
    ), text
