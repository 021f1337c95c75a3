"""The claim on a session name: one process at a time starts it; a killed holder blocks nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from nbdist.errors import NbdistError
from nbdist.launch import named_session_records

HOLD = """
import sys, time
from nbdist.launch import named_session_records
with named_session_records.claim("train1"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def _holder() -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_name_another_process_is_starting_is_refused_naming_it(runtime):
    holder = _holder()
    try:
        with pytest.raises(
            NbdistError, match=rf"being started by another kernel \(PID {holder.pid}\)"
        ):
            with named_session_records.claim("train1"):
                pass
        with named_session_records.claim("other"):  # another name is free
            pass
    finally:
        holder.send_signal(signal.SIGKILL)  # killed while holding it
        holder.wait()
    with named_session_records.claim("train1"):  # the lock went with its holder
        assert named_session_records.records() == []  # the claim is no session
    assert os.listdir(named_session_records.sessions_dir()) == []  # nothing left of it


def test_one_process_claims_in_turn_and_leaves_no_file(runtime):
    for _ in range(3):
        with named_session_records.claim("train1"):
            with pytest.raises(NbdistError, match="being started by another kernel"):
                # A second claim, even from this process (another descriptor), waits its turn.
                with named_session_records.claim("train1"):
                    pass
    assert os.listdir(named_session_records.sessions_dir()) == []
