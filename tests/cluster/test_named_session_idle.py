"""Named sessions are not forgotten: idle ones end by themselves (--idle-timeout) or on request.

Idle means no kernel attached and no cell running on the ranks. Real keeper,
controller and engines; each test checks by PID that they are gone.
"""

from __future__ import annotations

import time

import pytest

from nbdist.driver.named_sessions import NamedSession, named_sessions, stop_idle, stop_named
from nbdist.launch import named_session_records
from tests.cluster.test_named_sessions import START_TIMEOUT, _session_pids
from tests.conftest import wait_gone

pytestmark = pytest.mark.slow  # a named session each: ~5 s on 2 cores


@pytest.fixture
def named(tmp_path, monkeypatch):
    """A private run history; the named sessions a test leaves behind are ended by their records."""
    monkeypatch.setenv("NBDIST_HISTORY", str(tmp_path / "history.sqlite"))
    names: list[str] = []
    yield names
    for name in names:
        if named_session_records.read(name) is not None:
            stop_named(name)


def _row(name: str) -> dict | None:
    return next((r for r in named_sessions() if r["name"] == name), None)


def _wait_idle(name: str, seconds: float, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = _row(name)
        if row is not None and row["idle_s"] is not None and row["idle_s"] >= seconds:
            return row
        time.sleep(0.2)
    raise AssertionError(f"session {name!r} not idle {seconds} s within {timeout} s: {_row(name)}")


def test_idle_timeout_ends_a_session_only_once_no_kernel_and_no_cell_uses_it(named):
    named.append("idle")
    session = NamedSession(2, cpu=True, name="idle", idle_timeout=3, timeout=START_TIMEOUT).start()
    pids = _session_pids("idle")
    time.sleep(5)  # attached for longer than the timeout: in use
    row = _row("idle")
    assert row["state"] == "running" and row["idle_s"] is None, row
    assert row["idle_timeout"] == 3 and row["memory"] > 0, row
    # A cell still running with no kernel attached keeps it in use too.
    session.run("import time\ntime.sleep(8)", block=False)
    session.detach()
    time.sleep(5)
    row = _row("idle")
    assert row is not None and row["state"] == "running" and row["idle_s"] is None, row
    # The cell ends; nobody attached: ended 3 s later (the keeper looks every 2 s).
    assert wait_gone(pids, timeout=30) == []
    assert named_session_records.read("idle") is None


def test_stop_idle_ends_the_sessions_idle_that_long_and_no_other(named):
    named.append("quiet")
    session = NamedSession(2, cpu=True, name="quiet", timeout=START_TIMEOUT).start()
    pids = _session_pids("quiet")
    assert stop_idle(1) == []  # attached: not idle
    session.detach()
    row = _wait_idle("quiet", 2)
    assert row["idle_timeout"] is None  # no --idle-timeout: it would run on
    assert stop_idle(3600) == []
    assert stop_idle(2) == ["quiet"]
    assert wait_gone(pids) == []
    assert _row("quiet") is None
