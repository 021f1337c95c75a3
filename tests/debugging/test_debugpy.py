"""%dist_debugpy: a real debugpy on a real rank, driven by a Debug Adapter Protocol client.

The magics run in a real IPython shell with 2 CPU ranks. The client below
speaks DAP over the socket as VS Code does (Content-Length framed JSON):
initialize, attach, setBreakpoints, configurationDone, then waits for
``stopped`` and reads the stopped rank's frames and variables.
"""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbdist.engine import debugpy_server
from nbdist.errors import NbdistError

STEP = "def step(x):\n    y = x * 10 + 1\n    return y\n"
STEP_LINE = 3  # `return y`: y is known there


class Dap:
    """A minimal DAP client: requests, and the events that came meanwhile."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buffer = b""
        self.seq = 0
        self.unread: list[dict] = []

    def close(self) -> None:
        self.sock.close()

    def send(self, command: str, **arguments) -> int:
        self.seq += 1
        body = json.dumps(
            {"seq": self.seq, "type": "request", "command": command, "arguments": arguments}
        ).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _message(self) -> dict:
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self._recv()
        head, rest = self.buffer.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"Content-Length: *(\d+)", head, re.I).group(1))
        while len(rest) < length:
            rest += self._recv()
        self.buffer = rest[length:]
        return json.loads(rest[:length])

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("the debug adapter closed the connection")
        return chunk

    def wait_for(self, matches, timeout: float = 60.0) -> dict:
        """The first message (already read or still to come) for which ``matches`` is true."""
        for i, msg in enumerate(self.unread):
            if matches(msg):
                return self.unread.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no such message within {timeout} s; read: {self.unread[-10:]}"
            self.sock.settimeout(left)
            msg = self._message()
            if matches(msg):
                return msg
            self.unread.append(msg)

    def event(self, name: str, timeout: float = 60.0) -> dict:
        return self.wait_for(lambda m: m.get("type") == "event" and m["event"] == name, timeout)

    def response(self, seq: int, timeout: float = 60.0) -> dict:
        reply = self.wait_for(
            lambda m: m.get("type") == "response" and m["request_seq"] == seq, timeout
        )
        assert reply["success"], reply
        return reply

    def request(self, command: str, **arguments) -> dict:
        return self.response(self.send(command, **arguments)).get("body") or {}

    def attach(self, breakpoints: dict[str, list[int]]) -> None:
        """The start-up sequence of a client attaching to a debugpy server."""
        self.request(
            "initialize",
            clientID="nbdist-test",
            adapterID="debugpy",
            pathFormat="path",
            linesStartAt1=True,
            columnsStartAt1=True,
        )
        attach = self.send("attach", justMyCode=False)
        self.event("initialized")
        for path, lines in breakpoints.items():
            found = self.request(
                "setBreakpoints", source={"path": path}, breakpoints=[{"line": n} for n in lines]
            )
            assert all(b["verified"] for b in found["breakpoints"]), found
        self.request("configurationDone")
        self.response(attach)

    def locals_when_stopped(self) -> tuple[int, list[dict], dict[str, str]]:
        """(thread, top frames, the top frame's locals) once a ``stopped`` event comes."""
        stopped = self.event("stopped")["body"]
        assert stopped["reason"] == "breakpoint", stopped
        thread = stopped["threadId"]
        frames = self.request("stackTrace", threadId=thread)["stackFrames"]
        scopes = self.request("scopes", frameId=frames[0]["id"])["scopes"]
        local = next(s for s in scopes if s["name"].lower().startswith("locals"))
        variables = self.request("variables", variablesReference=local["variablesReference"])
        return thread, frames, {v["name"]: v["value"] for v in variables["variables"]}


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    # The shell is a process-wide singleton: start from no session, whatever ran before.
    sh.run_line_magic("dist_stop", "")
    sh.magics_manager.registry["DistMagics"].session = None
    result = sh.run_cell("%dist_start 2 --timeout 120 --cpu")
    assert result.success, result.error_in_exec
    # A module the ranks import: DAP breakpoints go in files.
    folder = tmp_path_factory.mktemp("rankcode")
    (folder / "stepmod.py").write_text(STEP)
    ok(sh, f"%%on_all_ranks\nimport sys\nsys.path.insert(0, {str(folder)!r})\nimport stepmod")
    sh.stepmod = str(folder / "stepmod.py")
    yield sh
    sh.run_line_magic("dist_stop", "")


def ok(shell, text):
    result = shell.run_cell(text)
    assert result.success, result.error_in_exec or result.error_before_exec
    return result.result


def debugpy_on(shell, capsys, line: str) -> tuple[int, str]:
    """Run ``%dist_debugpy LINE``; the port it printed, and all it printed."""
    capsys.readouterr()
    ok(shell, f"%dist_debugpy {line}")
    out = capsys.readouterr().out
    found = re.search(r"debugpy (?:is already )?listening on 127\.0\.0\.1:(\d+)", out)
    assert found, out
    return int(found.group(1)), out


def test_attach_stops_rank_1_at_a_breakpoint_and_the_cell_finishes(shell, capsys):
    port, out = debugpy_on(shell, capsys, "1")
    assert '"type": "debugpy"' in out and '"request": "attach"' in out, out
    assert f'"port": {port}' in out and '"justMyCode": false' in out, out
    assert "JupyterLab's debugger" in out and "pathMappings" not in out, out
    ok(shell, "%%on_all_ranks\nprint('running', rank)")  # nobody attached: cells run
    assert "running 1" in capsys.readouterr().out

    client = Dap(port)
    try:
        client.attach({shell.stepmod: [STEP_LINE]})
        run = ok(shell, "%%on_all_ranks --noblock\nr = stepmod.step(rank)\nprint('done', rank, r)")
        thread, frames, local = client.locals_when_stopped()
        assert frames[0]["source"]["path"] == shell.stepmod and frames[0]["line"] == STEP_LINE
        assert local["x"] == "1" and local["y"] == "11", local  # rank 1's values
        deadline = time.monotonic() + 60
        while run.child_states()[0] != "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        # Rank 0 finished its part of the cell; rank 1 waits at the breakpoint.
        assert run.child_states() == {0: "ok", 1: "running"}, run.child_states()
        client.request("continue", threadId=thread)
        run.wait()
        out = capsys.readouterr().out
        assert "[rank 0] done 0 1" in out and "[rank 1] done 1 11" in out, out
        client.request("disconnect")
    finally:
        client.close()
    ok(shell, "%%on_all_ranks\nprint('after', stepmod.step(rank))")  # detached: no stop
    assert "[rank 1] after 11" in capsys.readouterr().out


def test_a_second_call_reports_the_same_listener(shell, capsys):
    first, _ = debugpy_on(shell, capsys, "1")
    again, out = debugpy_on(shell, capsys, "1 --port 0")
    assert again == first and "already listening" in out, out


def test_a_timeout_while_stopped_ends_the_cell_and_the_rank_stops_again_later(shell, capsys):
    port, _ = debugpy_on(shell, capsys, "1")
    client = Dap(port)
    try:
        client.attach({shell.stepmod: [STEP_LINE]})
        result = shell.run_cell("%%on_all_ranks --timeout 3\nprint('t', stepmod.step(rank))")
        assert not result.success and "--timeout 3" in str(result.error_in_exec)
        client.event("stopped")
        client.event("continued")  # the interrupt ended the stop: the client is told
        # The interrupt raised inside debugpy's tracer; the next cell traces rank 1 again.
        run = ok(shell, "%%on_all_ranks --noblock\nprint('u', stepmod.step(rank))")
        thread, _, local = client.locals_when_stopped()
        assert local["y"] == "11", local
        client.request("continue", threadId=thread)
        run.wait()
        assert "[rank 1] u 11" in capsys.readouterr().out
        client.request("disconnect")
    finally:
        client.close()


def test_a_listener_started_by_other_code_is_reported(shell, capsys):
    with socket.socket() as probe:  # a free port, for code that names its own
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    ok(shell, f"%%on_rank 0\nimport debugpy\ndebugpy.listen(('127.0.0.1', {free}))")
    port, out = debugpy_on(shell, capsys, "0")
    assert port == free and "started by other code" in out, out


@pytest.mark.parametrize(
    "line, message",
    [
        ("", "the following arguments are required: rank"),
        ("2", "rank '2': give a rank of this cluster, 0..1"),
        ("x", "rank 'x'"),
        ("1 --port 70000", "--port '70000': give a TCP port"),
        ("1 --port -1", "--port '-1'"),
    ],
)
def test_bad_input_is_a_usage_error(shell, line, message):
    with pytest.raises((UsageError, NbdistError), match=re.escape(message)):
        shell.run_line_magic("dist_debugpy", line)


def test_attach_text_for_a_rank_on_another_host_names_the_tunnel_and_path_mappings():
    endpoint = {
        "host": "127.0.0.1",
        "port": 5678,
        "rank": 3,
        "pid": 42,
        "hostname": "node7",
        "cwd": "/home/me/job",
        "new": True,
        "owner": "nbdist",
        "note": "",
        "connected": False,
    }
    text = debugpy_server.attach_text(endpoint, here="laptop")
    assert "ssh -N -L 5678:127.0.0.1:5678 node7" in text, text
    assert '"remoteRoot": "/home/me/job"' in text and '"host": "127.0.0.1"' in text, text
