"""JupyterLab's debugger with ranks on other machines (network namespaces): a real kernel.

A rank's debugpy listens on its own machine's loopback, which the kernel cannot
reach, and nbdist opens no debugger port beyond it: the kernel reaches it
through the engine's control channel instead. The test sends what JupyterLab's
debugger sends and reads what it would show: a breakpoint in a
``%%on_all_ranks`` cell stops the ranks in both namespaces, the Callstack lists
each as ``rank R · <module>``, a rank's Variables and an evaluate show that
rank's values, Continue lets the cell finish with its output; a breakpoint in a
file ``%dist_sync`` copied to each machine stops the ranks in their copies; ``%dist_stop``
or ``%dist_restart`` while ranks are paused lets them run on, closes the
relays and ends the kernel's threads for them, as switching the debugger off
does. Skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import time
import warnings

import pytest

from nbdist.driver.lab_debugger import RANKS_THREAD
from tests.debugging.test_lab_debugger import LabDebugClient, _debugger_on, _select_all, _stack
from tests.multihost.netns import namespaces_unavailable
from tests.multihost.test_netns import two_hosts  # noqa: F401 - the fixture
from tests.notebooks.conftest import Kernel

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    warnings.warn(f"multi-host test skipped: {_WHY_NOT}", pytest.PytestWarning, stacklevel=1)
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
)

# The kernel's threads for the debugger's connections to ranks.
_THREADS = (
    "import threading\n"
    "print('threads', sorted(t.name for t in threading.enumerate() if 'lab-debugger' in t.name))"
)


def _run(kernel: Kernel, dbg: LabDebugClient, code: str, timeout: float = 240) -> str:
    """Run ``code`` in the kernel, insist it succeeded; its output (read by ``dbg``, which
    keeps the debug events that arrive meanwhile)."""
    msg_id = kernel.submit(code)
    text = dbg.cell_output(msg_id, timeout=timeout)
    reply = kernel.reply(msg_id)
    assert reply["status"] == "ok", (code, reply, text)
    return text


def _variables(dbg: LabDebugClient, frame_id: int) -> dict[str, str]:
    found: dict[str, str] = {}
    for scope in dbg.request("scopes", frameId=frame_id)["body"]["scopes"]:
        body = dbg.request("variables", variablesReference=scope["variablesReference"])["body"]
        for var in body["variables"]:
            found.setdefault(var["name"], var["value"])
    return found


def test_ranks_on_other_machines_stop_at_breakpoints(two_hosts, tmp_path):  # noqa: F811
    hosts, client_file, procs = two_hosts
    kernel = Kernel()
    try:
        dbg = LabDebugClient(kernel)
        _run(kernel, dbg, "%load_ext nbdist")
        started = _run(kernel, dbg, f"%dist_start --connect {client_file} --timeout 120 --cpu")
        assert "4 ranks ready on 2 hosts" in started, started
        cell = "%%on_all_ranks\nr = rank * 10\nprint('here', rank, r)"
        path = _debugger_on(dbg, cell, [{"line": 3}])

        msg_id = kernel.submit(cell)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        threads = dbg.request("threads")["body"]["threads"]
        assert RANKS_THREAD in [t["id"] for t in threads], threads
        # The kernel's threads that poll the ranks are not the user's: not listed.
        assert not [t for t in threads if "lab-debugger" in t["name"]], threads
        tops = _stack(dbg)
        assert sorted(tops) == [0, 1, 2, 3], tops
        for rank, frame in tops.items():
            assert frame["name"] == f"rank {rank} · <module>", frame
            assert (frame["source"]["path"], frame["line"]) == (path, 3), frame

        # One rank in each namespace: its own variables, an evaluate in its frame.
        assert _variables(dbg, tops[1]["id"]).get("r") == "10"
        assert _variables(dbg, tops[2]["id"]).get("r") == "20"
        evaluated = dbg.request("evaluate", expression="r + rank", frameId=tops[3]["id"])
        assert evaluated["body"]["result"] == "33", evaluated

        _select_all(dbg)
        assert dbg.request("continue", threadId=1)["success"]
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok", text
        assert all(f"here {r} {r * 10}" in text for r in range(4)), text
        assert "not attached" not in text and "could not attach" not in text, text

        # Where the ranks' debugpy listens, seen from their own "machine": its loopback only.
        listens = _run(
            kernel,
            dbg,
            "%%on_all_ranks\nimport psutil\nfrom nbdist.engine import debugpy_server\n"
            "_port = debugpy_server.listening()['port']\n"
            "print('debugpy listens', sorted({c.laddr.ip for c in psutil.net_connections('inet')"
            " if c.status == psutil.CONN_LISTEN and c.laddr.port == _port}))",
        )
        said = [line for line in listens.splitlines() if "debugpy listens" in line]
        assert said and all(line.endswith("['127.0.0.1']") for line in said), listens

        # A file %dist_sync copied to each machine: a breakpoint set in it (at the notebook's
        # path) stops the relayed ranks in their copies, and their frames name that path.
        src = tmp_path / "relayed_src"
        src.mkdir()
        module = src / "relayed_helper.py"
        module.write_text("def twice(v):\n    w = v * 2\n    return w\n")
        assert "hold a copy" in _run(kernel, dbg, f"%dist_sync {src} --copy")
        breakpoint_in = dict(source={"path": str(module)}, breakpoints=[{"line": 3}])
        assert dbg.request("setBreakpoints", **breakpoint_in)["success"]
        dbg.events.clear()
        msg_id = kernel.submit(
            "%%on_all_ranks\nimport relayed_helper\nprint('twice', rank, relayed_helper.twice(rank))"
        )
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        tops = _stack(dbg)
        assert sorted(tops) == [0, 1, 2, 3], tops
        for rank, frame in tops.items():
            assert frame["name"] == f"rank {rank} · twice", frame
            assert (frame["source"]["path"], frame["line"]) == (str(module), 3), frame
        _select_all(dbg)
        assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok" and "twice 3 6" in text, text
        assert dbg.request("setBreakpoints", **dict(breakpoint_in, breakpoints=[]))["success"]

        # %dist_stop while the ranks are paused: the ranks of this connected cluster
        # outlive the session, so their relays must close and let them run on.
        dbg.events.clear()
        paused = "%%on_all_ranks --noblock\nw = rank\nprint('ran', w)"
        _debugger_on(dbg, paused, [{"line": 2}])
        _run(kernel, dbg, paused)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        _run(kernel, dbg, "%dist_stop")
        dbg.wait_event("continued", threadId=RANKS_THREAD, timeout=60)
        assert RANKS_THREAD not in [t["id"] for t in dbg.request("threads")["body"]["threads"]]
        assert "threads []" in _run(kernel, dbg, _THREADS)

        # The same engines again (free: the paused cell ran on): nothing relayed until a
        # cell needs the debugger, and the breakpoints stop them again.
        _run(kernel, dbg, f"%dist_start --connect {client_file} --timeout 120 --cpu")
        left = _run(
            kernel,
            dbg,
            "import nbdist\nfrom nbdist.engine import dap_relay\n"
            "print('open', nbdist.current_session().apply(dap_relay.is_open))",
        )
        assert "open [False, False, False, False]" in left, left
        dbg.events.clear()
        msg_id = kernel.submit(cell)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        _select_all(dbg)
        assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok", text
        assert "here 3 30" in text, text

        # %dist_restart while paused (a connected cluster: stop, then start on the same
        # engines): the same, and the next run stops again.
        dbg.events.clear()
        _run(kernel, dbg, paused)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        _run(kernel, dbg, "%dist_restart")
        dbg.wait_event("continued", threadId=RANKS_THREAD, timeout=60)
        assert "threads []" in _run(kernel, dbg, _THREADS)
        dbg.events.clear()
        msg_id = kernel.submit(cell)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=180)
        assert sorted(_stack(dbg)) == [0, 1, 2, 3]
        _select_all(dbg)
        assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok", text

        # The debugger switched off: relays closed, the kernel's threads for them gone.
        assert dbg.request("disconnect", restart=False, terminateDebuggee=True)["success"]
        deadline = time.monotonic() + 10
        while "threads []" not in (found := _run(kernel, dbg, _THREADS)):
            assert time.monotonic() < deadline, found
            time.sleep(0.2)
        assert "open [False, False, False, False]" in _run(
            kernel, dbg, "print('open', nbdist.current_session().apply(dap_relay.is_open))"
        )
    finally:
        kernel.shutdown()
