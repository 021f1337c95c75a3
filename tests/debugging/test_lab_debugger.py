"""JupyterLab's debugger on the ranks, at the protocol level: a real kernel, 2 CPU ranks.

The test sends the kernel what JupyterLab's debugger sends on the control
channel (``debug_request``: initialize, attach, debugInfo, dumpCell,
setBreakpoints, configurationDone), runs a ``%%on_all_ranks`` cell with a
breakpoint in its gutter, and reads what JupyterLab would show: the ``stopped``
events, the threads, one stack with both ranks' frames, a rank's variables, an
evaluate on a rank's frame, then continue and the cell's output.
"""

from __future__ import annotations

import queue
import re
import time

from nbdist.driver.lab_debugger import RANKS_THREAD
from tests.notebooks.conftest import Kernel

# As a notebook sends it: no newline at the end.
CELL = "%%on_all_ranks\nx = rank * 10\ny = x + 1\nprint('done', rank, y)"
LINE = 3  # `y = x + 1`, in the notebook cell's numbering (the magic line is 1)


class LabDebugClient:
    """JupyterLab's side of the Jupyter debug protocol, over a kernel client's control channel."""

    def __init__(self, kernel: Kernel):
        self.kc = kernel.kc
        self.seq = 0
        self.events: list[dict] = []
        self.started = False
        self.other: list[dict] = []  # iopub messages that are not debug events

    def request(self, command: str, timeout: float = 60.0, **arguments) -> dict:
        self.seq += 1
        content = {"seq": self.seq, "type": "request", "command": command, "arguments": arguments}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply = self.kc.get_control_msg(timeout=1.0)
            except queue.Empty:
                self._drain()
                continue
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                self._drain()
                return reply["content"]
        raise TimeoutError(f"no debug_reply to {command}")

    def _drain(self) -> None:
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                return
            if msg["msg_type"] == "debug_event":
                self.events.append(msg["content"])
            else:
                self.other.append(msg)

    def cell_output(self, msg_id: str, timeout: float = 120.0) -> str:
        """The stdout of cell ``msg_id`` once the kernel is idle again (this client reads iopub)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drain()
            mine = [m for m in self.other if m["parent_header"].get("msg_id") == msg_id]
            if any(
                m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                for m in mine
            ):
                return "".join(
                    m["content"].get("text", "") for m in mine if m["msg_type"] == "stream"
                )
            time.sleep(0.1)
        # What the cell itself got, and the debugger's events: every other message of the
        # module's kernel (status changes of each debug request) would bury them.
        mine = [
            (m["msg_type"], m["content"].get("text") or m["content"].get("evalue") or m["content"])
            for m in self.other
            if m["parent_header"].get("msg_id") == msg_id
        ]
        raise TimeoutError(
            f"cell {msg_id} did not finish; its messages: {mine!r}; debug events: {self.events!r}"
        )

    def wait_event(self, name: str, timeout: float = 90.0, count: int = 1, **body) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._drain()
            found = [
                e
                for e in self.events
                if e.get("event") == name
                and all(e.get("body", {}).get(k) == v for k, v in body.items())
            ]
            if len(found) >= count:
                return found
            time.sleep(0.1)
        said = "".join(
            m["content"].get("text", "") for m in self.other if m["msg_type"] == "stream"
        )
        raise TimeoutError(
            f"no {count} {name} event(s) {body}; got {self.events!r}; the kernel printed {said!r}"
        )


def _debugger_on(dbg: LabDebugClient, cell: str, breakpoints: list[dict]) -> str:
    """What JupyterLab sends when its debugger is switched on with breakpoints in ``cell``
    (the module's tests share one debug session: ipykernel 7.4's debugger does not answer
    an initialize that follows a disconnect, with nbdist or without)."""
    if not dbg.started:
        assert dbg.request("initialize", clientID="jupyterlab", adapterID="python")["success"]
        assert dbg.request("attach")["success"]
        dbg.started = True
    info = dbg.request("debugInfo")["body"]
    path = dbg.request("dumpCell", code=cell)["body"]["sourcePath"]
    assert path.startswith(info["tmpFilePrefix"])
    reply = dbg.request(
        "setBreakpoints", source={"path": path}, breakpoints=breakpoints, sourceModified=False
    )
    assert reply["success"]
    assert dbg.request("configurationDone")["success"]
    return path


def _stop_ranks_in(kernel, dbg: LabDebugClient, cell: str, line: int, timeout: float = 120) -> str:
    """Debugger on with a breakpoint at ``line`` of ``cell``, the cell sent, both ranks
    stopped there (their ``stopped`` events in); the cell's message id."""
    dbg.events.clear()
    _debugger_on(dbg, cell, [{"line": line}])
    msg_id = kernel.submit(cell)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=timeout)
    return msg_id


def _stack(dbg: LabDebugClient) -> dict[int, dict]:
    """The top frame of each stopped rank, as the Callstack panel lists them."""
    frames = dbg.request("stackTrace", threadId=RANKS_THREAD)["body"]["stackFrames"]
    tops: dict[int, dict] = {}
    for frame in frames[1:]:  # the first: the summary frame of every stopped rank
        tops.setdefault(int(frame["name"].split()[1]), frame)
    return tops


def _select_all(dbg: LabDebugClient) -> None:
    """Select the Callstack's first frame, the summary of every stopped rank (JupyterLab
    selects it after each stop): Continue then resumes every stopped rank."""
    frames = dbg.request("stackTrace", threadId=RANKS_THREAD)["body"]["stackFrames"]
    dbg.request("scopes", frameId=frames[0]["id"])


def test_breakpoint_in_a_cells_gutter_stops_both_ranks(lab):
    kernel, dbg = lab
    path = _debugger_on(dbg, CELL, [{"line": LINE}])

    msg_id = kernel.submit(CELL)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    threads = dbg.request("threads")["body"]["threads"]
    assert any(t["id"] == RANKS_THREAD for t in threads), threads

    tops = _stack(dbg)
    assert sorted(tops) == [0, 1], tops
    for rank, frame in tops.items():
        assert frame["name"].startswith(f"rank {rank} · "), frame
        assert frame["source"]["path"] == path, frame
        assert frame["line"] == LINE, frame

    # Selecting rank 1's frame: its scopes, its variables, an evaluate there.
    scopes = dbg.request("scopes", frameId=tops[1]["id"])["body"]["scopes"]
    variables = {}
    for scope in scopes:
        body = dbg.request("variables", variablesReference=scope["variablesReference"])["body"]
        for var in body["variables"]:
            variables.setdefault(var["name"], var["value"])
    assert variables.get("x") == "10", sorted(variables)
    evaluated = dbg.request(
        "evaluate", expression="x + rank", frameId=tops[0]["id"], context="repl"
    )
    assert evaluated["body"]["result"] == "0"
    evaluated = dbg.request(
        "evaluate", expression="x + rank", frameId=tops[1]["id"], context="repl"
    )
    assert evaluated["body"]["result"] == "11"

    # JupyterLab's Continue: it drops the stopped thread first, then names thread 1.
    _select_all(dbg)
    assert dbg.request("continue", threadId=1)["success"]
    text = dbg.cell_output(msg_id)
    reply = kernel.reply(msg_id)
    assert reply["status"] == "ok", reply
    assert "done 0 1" in text and "done 1 11" in text, text


def test_conditional_breakpoint_and_next_act_on_one_rank(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "%%on_all_ranks\nx = rank * 10\ny = x + 1\nprint('stepped', rank, y)\n"
    path = _debugger_on(dbg, cell, [{"line": 2, "condition": "rank == 1"}])
    msg_id = kernel.submit(cell)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, timeout=120)
    tops = _stack(dbg)
    assert sorted(tops) == [1], tops  # the condition held on rank 1 only
    assert (tops[1]["source"]["path"], tops[1]["line"]) == (path, 2)
    dbg.request("scopes", frameId=tops[1]["id"])  # JupyterLab selects the top frame
    assert dbg.request("next", threadId=RANKS_THREAD)["success"]
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=60)
    tops = _stack(dbg)
    assert tops[1]["line"] == 3, tops
    assert dbg.request("evaluate", expression="x", frameId=tops[1]["id"])["body"]["result"] == "10"
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    assert "stepped 1 11" in dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"


def test_cells_in_the_kernel_debug_as_before(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "a = 41\nb = a + 1\nprint('kernel', b)\n"
    path = _debugger_on(dbg, cell, [{"line": 2}])
    msg_id = kernel.submit(cell)
    stopped = dbg.wait_event("stopped", timeout=60)[0]["body"]
    assert stopped["threadId"] != RANKS_THREAD
    frames = dbg.request("stackTrace", threadId=stopped["threadId"])["body"]["stackFrames"]
    assert (frames[0]["source"]["path"], frames[0]["line"]) == (path, 2), frames[0]
    assert dbg.request("continue", threadId=stopped["threadId"])["success"]
    assert "kernel 42" in dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"


def test_pause_on_uncaught_exceptions_stops_the_rank_that_raises(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "%%on_all_ranks\nx = rank\nif rank == 1:\n    raise ValueError('rank 1 fails')\nprint('ok', rank)\n"
    _debugger_on(dbg, cell, [])
    # "Pause on exceptions", user-unhandled: ("raised" also stops the kernel's own
    # threads on exceptions its libraries catch, as it does without nbdist).
    assert dbg.request("setExceptionBreakpoints", filters=["userUnhandled"])["success"]
    msg_id = kernel.submit(cell)
    stopped = dbg.wait_event("stopped", threadId=RANKS_THREAD, timeout=120)[0]["body"]
    assert stopped["reason"] == "exception", stopped
    tops = _stack(dbg)
    assert sorted(tops) == [1] and tops[1]["line"] == 4, tops
    assert dbg.request("setExceptionBreakpoints", filters=[])["success"]
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    # The cell fails in the kernel as it would without the debugger (the kernel's own
    # debugger may stop on that error too: continue it).
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        dbg._drain()
        kernel_stops = [
            e["body"]["threadId"]
            for e in dbg.events
            if e.get("event") == "stopped" and e["body"]["threadId"] != RANKS_THREAD
        ]
        for thread in kernel_stops:
            dbg.request("continue", threadId=thread)
        dbg.events = [e for e in dbg.events if e.get("event") != "stopped"]
        if any(
            m["parent_header"].get("msg_id") == msg_id
            and m["msg_type"] == "status"
            and m["content"]["execution_state"] == "idle"
            for m in dbg.other
        ):
            break
        time.sleep(0.2)
    assert kernel.reply(msg_id)["status"] == "error"
    text = dbg.cell_output(msg_id)
    assert "ok 0" in text, text


def test_interrupting_the_kernel_while_ranks_are_paused(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "%%on_all_ranks\nz = rank + 5\nprint('z', z)\n"
    path = _debugger_on(dbg, cell, [{"line": 2}])
    msg_id = kernel.submit(cell)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    kernel.km.interrupt_kernel()
    said = dbg.cell_output(msg_id)
    reply = kernel.reply(msg_id)
    assert reply["status"] == "error"
    # The traceback ends at the cell's line where the rank was paused, once, not in
    # debugpy's wait (whose frames also made each rank format it for seconds), and
    # nothing says the user's code caught the KeyboardInterrupt.
    shown = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(reply["traceback"]))
    assert "pydevd" not in shown and "threading.py" not in shown, shown
    assert shown.count("----> 2 z = rank + 5") == 1, shown
    assert "caught the KeyboardInterrupt" not in said + shown, (said, shown)
    # The Callstack no longer shows the ranks as paused.
    threads = dbg.request("threads")["body"]["threads"]
    assert RANKS_THREAD not in [t["id"] for t in threads], threads
    # The ranks are usable, and the breakpoint stops them again in the next run.
    dbg.events.clear()
    msg_id = kernel.submit(cell)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} == {2}, tops
    assert tops[0]["source"]["path"] == path
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "z 5" in text and "z 6" in text, text


def test_a_rank_whose_debugger_swallowed_the_interrupts_is_interrupted_again(lab):
    # debugpy catches every exception raised while a paused thread handles one of its
    # requests: interrupts landing then (the kernel's, and the release's after it) left
    # the rank paused in the interrupted cell, and the next cell waited behind it with
    # the rank shown running. Here rank 1's debugpy swallows the first two that way.
    kernel, dbg = lab
    cell = "%%on_all_ranks\nz = rank + 5\nprint('z', z)\n"
    _debugger_on(dbg, cell, [{"line": 2}])  # debugpy runs on the ranks from the next cell
    kernel.ok(
        "%%on_all_ranks\nimport pydevd\n_wait = pydevd.PyDB._do_wait_suspend\n_left = [2]\n"
        "def _swallowing(self, *args, **kwargs):\n"
        "    while True:\n"
        "        try:\n"
        "            return _wait(self, *args, **kwargs)\n"
        "        except KeyboardInterrupt:\n"
        "            _left[0] -= 1\n"
        "            if not _left[0]:\n"
        "                pydevd.PyDB._do_wait_suspend = _wait\n"
        "            if _left[0] < 0:\n"
        "                raise\n"
        "if rank == 1:\n"
        "    pydevd.PyDB._do_wait_suspend = _swallowing\n"
    )
    msg_id = _stop_ranks_in(kernel, dbg, cell, 2)
    kernel.km.interrupt_kernel()
    dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "error"
    # No rank is left paused: the next run stops both at the breakpoint, as a breakpoint.
    dbg.events.clear()
    msg_id = kernel.submit(cell)
    stops = dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    assert sorted(e["body"]["reason"] for e in stops) == ["breakpoint", "breakpoint"], stops
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "z 5" in text and "z 6" in text, text


def _both_stop_in(dbg, kernel, cell: str, module, function: str) -> tuple[str, dict]:
    """Submit ``cell``; both ranks stop in ``function`` at line 3 of ``module``. (msg id, tops)."""
    msg_id = kernel.submit(cell)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1], tops
    for rank, frame in tops.items():
        assert frame["name"] == f"rank {rank} · {function}", frame
        assert (frame["source"]["path"], frame["line"]) == (str(module), 3), frame
    return msg_id, tops


def test_breakpoint_in_a_file_the_ranks_import(lab, tmp_path):
    kernel, dbg = lab
    dbg.events.clear()
    module = tmp_path / "lab_debug_helper.py"
    module.write_text("def scale(v):\n    w = v * 3\n    return w\n")
    _debugger_on(dbg, "%%on_all_ranks\npass\n", [])
    assert dbg.request("setBreakpoints", source={"path": str(module)}, breakpoints=[{"line": 3}])[
        "success"
    ]
    cell = (
        f"%%on_all_ranks\nimport sys\nsys.path.insert(0, {str(tmp_path)!r})\n"
        "from lab_debug_helper import scale\nprint('scaled', rank, scale(rank + 1))\n"
    )
    msg_id, tops = _both_stop_in(dbg, kernel, cell, module, "scale")
    scopes = dbg.request("scopes", frameId=tops[1]["id"])["body"]["scopes"]
    names = {}
    for scope in scopes:
        body = dbg.request("variables", variablesReference=scope["variablesReference"])["body"]
        names.update({v["name"]: v["value"] for v in body["variables"]})
    assert names.get("w") == "6", names
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert "scaled 0 3" in text and "scaled 1 6" in text, text


def test_breakpoint_in_a_synced_file_stops_ranks_that_run_its_copy(lab, tmp_path):
    kernel, dbg = lab
    dbg.events.clear()
    src = tmp_path / "synced_src"
    src.mkdir()
    module = src / "synced_helper.py"
    module.write_text("def triple(v):\n    w = v * 3\n    return w\n")
    _debugger_on(dbg, "%%on_all_ranks\npass\n", [])
    # The breakpoint first, the copy after: the router sets it again at the copy's path.
    assert dbg.request("setBreakpoints", source={"path": str(module)}, breakpoints=[{"line": 3}])[
        "success"
    ]
    msg_id = kernel.submit(f"%dist_sync {src} --copy")
    assert "1 holds a copy (1 file sent" in dbg.cell_output(msg_id)
    cell = (
        "%%on_all_ranks\nimport synced_helper\nprint('from', synced_helper.__file__)\n"
        "print('tripled', rank, synced_helper.triple(rank + 1))\n"
    )
    # Named as JupyterLab knows the file, where the rank runs its copy.
    msg_id, _ = _both_stop_in(dbg, kernel, cell, module, "triple")
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert "tripled 0 3" in text and "tripled 1 6" in text, text
    assert "nbdist-sync-" in text and f"from {module}" not in text, text
    # Removed in JupyterLab: gone at the copy's path too, the ranks run through.
    assert dbg.request("setBreakpoints", source={"path": str(module)}, breakpoints=[])["success"]
    dbg.events.clear()
    msg_id = kernel.submit(cell)
    assert "tripled 1 6" in dbg.cell_output(msg_id)
    assert not [e for e in dbg.events if e.get("event") == "stopped"], dbg.events
    # Set again now that the ranks run the copy: it reaches the copy's path at once.
    assert dbg.request("setBreakpoints", source={"path": str(module)}, breakpoints=[{"line": 3}])[
        "success"
    ]
    msg_id, _ = _both_stop_in(dbg, kernel, cell, module, "triple")
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    assert "tripled 1 6" in dbg.cell_output(msg_id)
    assert dbg.request("setBreakpoints", source={"path": str(module)}, breakpoints=[])["success"]


def test_switching_the_debugger_off_lets_the_ranks_run_through(lab):
    kernel, dbg = lab
    assert dbg.started, "runs after the tests that set breakpoints"
    assert dbg.request("disconnect", restart=False, terminateDebuggee=True)["success"]
    dbg.events.clear()
    # The first test's breakpoint is still in the same cell's gutter: nothing stops now.
    msg_id = kernel.submit(CELL)
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "done 0 1" in text and "done 1 11" in text, text
    assert not [e for e in dbg.events if e.get("event") == "stopped"], dbg.events
    # And the ranks run untraced again: no debugger cost once it is off.
    msg_id = kernel.submit(
        "%%on_all_ranks\nimport sys\nprint('traced', sys.gettrace() is not None)\n"
    )
    text = dbg.cell_output(msg_id)
    assert "traced False" in text and "traced True" not in text, text
