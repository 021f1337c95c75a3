"""The pure parts: how a death is worded, the hang diagnosis, the collective records, status lines."""

from __future__ import annotations

import functools
import signal

import pytest

from nbdist.driver.collective_waits import _paired_words
from nbdist.driver.rank_deaths import dead_ranks_message, death_cause
from nbdist.driver.status import format_status
from nbdist.driver.where import RankWhere, diagnose, format_where
from nbdist.engine import collectives
from nbdist.errors import format_ranks


@pytest.mark.parametrize(
    "status, words",
    [
        (
            signal.SIGKILL,
            "killed by SIGKILL (signal 9): kill -9, or the kernel's out-of-memory killer",
        ),
        (signal.SIGSEGV | 0x80, "crashed: segmentation fault (SIGSEGV, signal 11)"),
        (signal.SIGTERM, "killed by SIGTERM (signal 15)"),
        (3 << 8, "exited with code 3"),
        (None, "exited (exit status not available)"),
    ],
)
def test_death_cause_words(status, words):
    assert death_cause(status).startswith(words)


def _c(op, seq, inside, seconds=1.0, raised=False):
    return {"op": op, "seq": seq, "inside": inside, "seconds": seconds, "raised": raised}


def test_diagnose_names_who_never_entered():
    found = [
        RankWhere(0, True, busy=True, collective=_c("all_reduce", 118, True, 42.0)),
        RankWhere(1, True, busy=True, collective=_c("all_reduce", 117, False, 42.1)),
        RankWhere(2, True, busy=True, collective=None),
        RankWhere(3, False, note="no answer within 3 s (dead, or native code holding the GIL)"),
    ]
    assert diagnose(found) == {
        0: "inside all_reduce #118 for 42.0 s",
        1: "never entered all_reduce #118 (last: all_reduce #117, returned 42.1 s ago)",
        2: "never entered all_reduce #118 (last: none yet)",
        3: "no answer within 3 s (dead, or native code holding the GIL)",
    }


def test_diagnose_without_a_waiting_rank_and_the_stack_lines():
    frame = {"file": "/tmp/cell.py", "line": 3, "name": "<module>", "code": "time.sleep(9)"}
    found = [
        RankWhere(
            0, True, busy=True, stack=[frame], collective=_c("barrier", 4, False, raised=True)
        ),
        RankWhere(1, True, busy=False, collective=None),
    ]
    assert format_where(found).splitlines() == [
        "rank 0: last collective barrier #4, raised 1.0 s ago",
        '  File "/tmp/cell.py", line 3, in <module>: time.sleep(9)',
        "rank 1: no collective since the group formed; idle",
    ]


def test_collective_records_inside_returned_and_raised():
    seen = []

    def op(fail=False):
        seen.append(collectives.last())
        if fail:
            raise RuntimeError("Connection closed by peer")

    tracked = collectives._tracked("all_reduce", op)
    collectives.reset()
    try:
        assert collectives.last() is None
        tracked()
        assert seen[0]["inside"] and (seen[0]["op"], seen[0]["seq"]) == ("all_reduce", 1)
        after = collectives.last()
        assert (after["seq"], after["inside"], after["raised"]) == (1, False, False)
        with pytest.raises(RuntimeError):
            tracked(fail=True)
        after = collectives.last()
        assert (after["seq"], after["inside"], after["raised"]) == (2, False, True)
        assert tracked.nbdist_original is op
    finally:
        collectives.reset()


def test_a_collective_record_names_its_first_tensors_dtype_and_shape():
    import torch

    tracked = collectives._tracked("all_reduce", lambda *args: None)
    collectives.reset()
    try:
        tracked(torch.ones(2, 3))
        assert collectives.last()["tensor"] == "float32 [2, 3]"
        tracked([torch.zeros(4, dtype=torch.int64), torch.zeros(1)])  # all_gather's list
        assert collectives.last()["tensor"] == "int64 [4]"
        tracked(torch.tensor(1.0, dtype=torch.bfloat16))
        assert collectives.last()["tensor"] == "bfloat16 []"
        for no_tensor in ((), ([None, None],), ("a text",)):  # barrier, object lists
            tracked(*no_tensor)
            assert collectives.last()["tensor"] is None, no_tensor
    finally:
        collectives.reset()


def test_a_tensor_given_by_keyword_is_recorded_as_one_given_by_position():
    # torch's own functions, for their parameters' names; the calls themselves are not made.
    import torch
    import torch.distributed as dist

    def signature_of(fn):
        return functools.wraps(fn)(lambda *args, **kwargs: None)

    collectives.reset()
    try:
        for op, kwargs, words in (
            ("all_reduce", {"tensor": torch.ones(2, 3)}, "float32 [2, 3]"),
            ("send", {"tensor": torch.ones(5, dtype=torch.float16), "dst": 1}, "float16 [5]"),
            (
                "all_gather",
                {"tensor_list": [torch.zeros(4)], "tensor": torch.zeros(4)},
                "float32 [4]",
            ),
            (
                "all_gather_into_tensor",
                {"input_tensor": torch.zeros(2), "output_tensor": torch.zeros(4)},
                "float32 [4]",
            ),
            ("barrier", {"group": None}, None),
        ):
            tracked = collectives._tracked(op, signature_of(getattr(dist, op)))
            tracked(**kwargs)
            assert collectives.last()["tensor"] == words, op
    finally:
        collectives.reset()


@pytest.mark.parametrize(
    ("mine", "theirs", "words"),
    [
        (
            "float32 [4]",
            {1: "float32 [1]"},
            "waited in all_reduce #3 with float32 [4] for rank 1 with float32 [1], which made "
            "all_reduce #3 too and returned from it: the calls paired but their tensors differ",
        ),
        (
            "float32 [4]",
            {1: "float32 [1]", 2: "float32 [1]", 3: "float32 [2]"},
            "waited in all_reduce #3 with float32 [4] for ranks 1 and 2 with float32 [1], rank 3 "
            "with float32 [2], which made all_reduce #3 too and returned from it: the calls "
            "paired but their tensors differ",
        ),
        # Not known on one side, or alike (what differs is not the first tensor): a guess.
        (
            None,
            {1: "float32 [1]"},
            "waited in all_reduce #3 for rank 1, which made all_reduce #3 too and returned from "
            "it: the calls paired but differ (another size, dtype or shape on each rank?)",
        ),
        (
            "float32 [4]",
            {1: "float32 [4]", 2: None},
            "waited in all_reduce #3 for ranks 1 and 2, which made all_reduce #3 too and returned "
            "from it: the calls paired but differ (another size, dtype or shape on each rank?)",
        ),
    ],
)
def test_paired_calls_are_named_by_the_tensors_that_differ(mine, theirs, words):
    call = {"op": "all_reduce", "seq": 3, "tensor": mine}
    assert _paired_words(call, theirs) == words


def _one_dead_rank(engines: tuple[int, int]) -> list[dict]:
    """%dist_status rows of two ranks on engines ``engines``: rank 0 idle, rank 1 killed."""
    common = dict(host="h", device="cpu", backend="gloo")
    return [
        dict(common, rank=0, engine=engines[0], pid=10, state="idle", memory_mib=200.0, died=None),
        dict(
            common,
            rank=1,
            engine=engines[1],
            pid=11,
            state="dead",
            memory_mib=None,
            died="pid 11 killed by SIGKILL (signal 9)",
        ),
    ]


def test_status_says_how_a_dead_rank_died():
    rows = _one_dead_rank(engines=(0, 1))
    lines = format_status(rows).splitlines()
    assert lines[2].split()[-2:] == ["dead", "?"]
    assert lines[3:] == [
        "rank 1 died: pid 11 killed by SIGKILL (signal 9)",
        "%dist_restart brings every rank back",
    ]


def test_ranks_killed_alike_are_one_line_of_status_and_of_the_error():
    """Ranks the out-of-memory killer took: one line with their pids' range, not a line per
    rank (%dist_status lists at most 16 deviating ranks; the error names every dead rank); a
    rank that died otherwise keeps its own line."""
    common = dict(host="h", device="cpu", backend="gloo", memory_mib=None, state="dead")

    def killed(rank):
        return f"pid {1000 + rank} killed by SIGKILL (signal 9)"

    rows = [dict(common, rank=r, engine=r, pid=1000 + r, died=killed(r)) for r in range(0, 20, 2)]
    rows.append(dict(common, rank=81, engine=81, pid=2000, died="exited with status 1"))
    rows += [
        dict(common, rank=r, engine=r, pid=3000 + r, state="idle", memory_mib=100.0, died=None)
        for r in range(82, 256)
    ]
    notes = format_status(rows).splitlines()[-3:]
    assert notes == [
        "ranks 0,2,4,6,8,10,12,14,16,18 died: pid 1000–1018 killed by SIGKILL (signal 9)",
        "rank 81 died: exited with status 1",
        "%dist_restart brings every rank back",
    ]
    dead = {r: killed(r) for r in range(0, 80, 2)}
    dead[81] = "exited with status 1"
    assert dead_ranks_message(dead, "restart", None) == (
        f"{format_ranks(range(0, 80, 2))} died: pid 1000–1078 killed by SIGKILL (signal 9); "
        "rank 81 died: exited with status 1. restart"
    )


def test_oom_counter_reads_cgroup_v2_and_v1_files(tmp_path):
    """The counter files as cgroup v2 (memory.events) and v1 (memory.oom_control) write them."""
    from nbdist.driver.oom import OomCounter

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n")
    (v2 / "memory.max").write_text("max\n")
    counter = OomCounter(str(v2), "memory.events", 1)
    assert not counter.rose() and counter.limit() == ""
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\n")
    (v2 / "memory.max").write_text(f"{3 << 30}\n")
    assert counter.rose() and counter.limit() == "3.00 GiB"

    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    counter = OomCounter(str(v1), "memory.oom_control", 0)
    assert not counter.rose() and counter.limit() == ""
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert counter.rose()
    words = death_cause(signal.SIGKILL, counter)
    assert words.startswith("killed by the kernel's out-of-memory killer (SIGKILL): its memory")
    assert str(v1) in words


def test_status_html_colours_ranks_and_marks_the_dead():
    """The notebook's %dist_status: the text table's cells, each rank in its dashboard colour,
    a dead rank's state in red and how it died under the table."""
    from nbdist.dashboard.palette import rank_colour
    from nbdist.driver.status import StatusTable

    rows = _one_dead_rank(engines=(5, 6))
    table = StatusTable(rows)
    html = table._repr_html_()
    assert f"color:{rank_colour(0)}" in html and f"color:{rank_colour(1)}" in html
    assert "<b style='color:#c62828'>dead</b>" in html
    assert "<div>rank 1 died: pid 11 killed by SIGKILL (signal 9)</div>" in html
    assert ">engine<" not in html and "engine" not in repr(table)
    assert repr(table) == format_status(rows)


def _hang_at(n: int, sleeping: tuple[int, ...]) -> list[RankWhere]:
    """``n`` ranks inside barrier #1 but ``sleeping``, which never entered it (as 64 real ranks did)."""
    torch_frames = [
        {
            "file": "/venv/torch/distributed/c10d_logger.py",
            "line": 83,
            "name": "wrapper",
            "code": "return func(*args, **kwargs)",
        },
        {
            "file": "/venv/torch/distributed/distributed_c10d.py",
            "line": 5356,
            "name": "barrier",
            "code": "work.wait()",
        },
    ]
    found = []
    for r in range(n):
        cell = f"/tmp/ipykernel_{17002 + r}/2679722123.py"
        if r in sleeping:
            stack = [{"file": cell, "line": 3, "name": "<module>", "code": "time.sleep(25)"}]
            c = None
        else:
            stack = [{"file": cell, "line": 4, "name": "<module>", "code": "dist.barrier()"}]
            stack += torch_frames
            c = _c("barrier", 1, True, 6.0 + (r % 3) / 10)
        flight = [
            {
                "seq": 1,
                "op": "barrier",
                "group": "default_pg",
                "state": "scheduled",
                "sizes": [],
                "done": False,
            }
        ]
        found.append(
            RankWhere(
                r,
                True,
                busy=True,
                stack=stack,
                collective=c,
                flight=None if r in sleeping else flight,
            )
        )
    return found


def test_where_at_256_ranks_names_each_diagnosis_and_stack_once_the_odd_ones_first():
    found = _hang_at(256, sleeping=(17, 40))
    found[100] = RankWhere(
        100, False, note="no answer within 3 s (dead, or native code holding the GIL)"
    )
    assert format_where(found).splitlines() == [
        "rank 100: no answer within 3 s (dead, or native code holding the GIL)",
        "ranks 17,40: never entered barrier #1 (last: none yet)",
        '  File "/tmp/ipykernel_17019/2679722123.py", line 3, in <module>: time.sleep(25)',
        "ranks 0-16,18-39,41-99,101-255: inside barrier #1 for 6.0-6.2 s",
        '  File "/tmp/ipykernel_17002/2679722123.py", line 4, in <module>: dist.barrier()',
        '  File "/venv/torch/distributed/c10d_logger.py", line 83, in wrapper: '
        "return func(*args, **kwargs)",
        '  File "/venv/torch/distributed/distributed_c10d.py", line 5356, in barrier: work.wait()',
        "flight recorder (the process group's last collectives, C++-issued ones included):",
        "  ranks 17,40: none since the group formed",
        "  ranks 0-16,18-39,41-99,101-255: #1 barrier",
        "  ranks 17,40 are behind: no collective yet, another rank's last is #1",
    ]


def test_where_keeps_ranks_apart_whose_stacks_differ_and_says_when_one_is_behind():
    found = _hang_at(4, sleeping=(2, 3))
    found[3].stack[0]["code"] = "time.sleep(99)"
    found[3].stack[0]["line"] = 5
    lines = format_where(found).splitlines()
    assert lines[:4] == [
        "rank 2: never entered barrier #1 (last: none yet)",
        '  File "/tmp/ipykernel_17004/2679722123.py", line 3, in <module>: time.sleep(25)',
        "rank 3: never entered barrier #1 (last: none yet)",
        '  File "/tmp/ipykernel_17005/2679722123.py", line 5, in <module>: time.sleep(99)',
    ]
    assert lines[4] == "ranks 0-1: inside barrier #1 for 6.0-6.1 s"
    found[2].flight = [
        {"seq": 1, "op": "all_reduce", "group": "default_pg", "state": "scheduled", "sizes": [[1]]}
    ]
    found[3].flight = [dict(found[0].flight[0], seq=2)]
    assert format_where(found).splitlines()[-1] == (
        "  ranks 0-2 are behind: their last collective is #1, another rank's is #2"
    )
