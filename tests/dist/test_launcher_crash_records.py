"""A dead rank's crash record on another machine, read and removed through a live rank there.

The ranks a launcher starts (Slurm, MPI, SSH) keep their own crash records on
their machines (nbdist.engine.crash_record); tests/cluster/test_slurm_launch.py
crashes one for real. Here real engines play a host the kernel cannot read:
the group's RankInfo say the ranks run on "other", so the kernel must ask a live
rank of that host, over the control channel, for the dead rank's record.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

import nbdist
from nbdist.driver.launcher_crashes import CrashRecords
from nbdist.driver.where import control_request
from nbdist.engine import crash_record

DUMP = """Fatal Python error: Segmentation fault

Current thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at
  File "/tmp/ipykernel_4242/3141.py", line 3 in <module>
  File "/venv/lib/python3.11/site-packages/IPython/core/interactiveshell.py", line 3577 in run_code
"""


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120, history=False) as s:
        yield s


@pytest.fixture
def dead_record(session):
    """A record left by a rank that died (its PID ends no process), where the ranks keep theirs."""
    folder = session.client[session.ranks[0].engine_id].apply_sync(crash_record.record_dir)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, "other-0000abcd-999999.txt")
    with open(path, "w") as f:
        f.write(DUMP)
    yield path
    if os.path.exists(path):
        os.remove(path)


def _on_other_host(session, dead_path: str) -> list:
    """The group's ranks as if on host "other", plus a dead rank 2 there with ``dead_path``."""
    ranks = [dataclasses.replace(r, host="other", pid_here=False) for r in session.ranks]
    dead = dataclasses.replace(ranks[1], rank=2, engine_id=10_000, crash_record=dead_path)
    return [*ranks, dead]


def test_a_dead_ranks_record_is_read_by_a_live_rank_of_its_host_and_removed_at_stop(
    session, dead_record
):
    records = CrashRecords(_on_other_host(session, dead_record))
    words = records.words(2, session.client)
    assert (
        words
        == "crashed: Segmentation fault, in string_at (ctypes/__init__.py:519), from the cell, line 3"
    )
    records.remove(session.client)
    assert not os.path.exists(dead_record)


def test_with_no_live_rank_on_its_host_the_line_says_where_the_record_is(session, dead_record):
    ranks = _on_other_host(session, dead_record)
    alone = [dataclasses.replace(r, host="elsewhere") if r.rank != 2 else r for r in ranks]
    words = CrashRecords(alone).words(2, session.client)
    assert words == f"its crash record, if it crashed, is on other: {dead_record}"


def test_a_rank_reads_no_file_but_crash_records_for_the_kernel(session, tmp_path):
    secret = tmp_path / "other-0000abcd-1.txt"  # a record's name, outside the records' folder
    secret.write_text("not a record")
    eid = session.ranks[0].engine_id
    (read,) = control_request(session.client, [eid], "crash_record", 5, path=str(secret))
    assert read == {"status": "ok", "record": None}
    (removed,) = control_request(
        session.client, [eid], "crash_record", 5, path=str(secret), remove=True
    )
    assert removed == {"status": "ok", "removed": False}
    assert secret.read_text() == "not a record"
