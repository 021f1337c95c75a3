"""The rank side of the debugger's relay (nbdist/engine/dap_relay.py) with a real debugpy.

It runs in a process of its own (debugpy, once listening, traces the process it
runs in): the script below calls the relay's control actions as the engine's
control thread would, with a real ZeroMQ socket standing for the control
channel, and prints what it saw.
"""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys, threading, time
import zmq
from nbdist.engine import dap_relay, debugpy_server

seen = {}
endpoint = debugpy_server.listen()
seen["traced_before_open"] = sys.gettrace() is not None
context = zmq.Context()
control, kernel = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
control.bind("inproc://control")
kernel.connect("inproc://control")

try:
    dap_relay.handle("dap_open", {"port": endpoint["port"] + 1})
except ValueError as exc:
    seen["other_port"] = str(exc)
opened = dap_relay.handle("dap_open", {"port": endpoint["port"]})
token = opened["token"]
seen["pid_matches"] = opened["pid"] == endpoint["pid"]
seen["marked"] = getattr(threading.current_thread(), "pydev_do_not_trace", False)
seen["traced_after_open"] = sys.gettrace() is not None

initialize = {"seq": 1, "type": "request", "command": "initialize",
              "arguments": {"adapterID": "debugpy", "clientID": "test"}}
seen["sent"] = dap_relay.handle("dap_send", {"token": token, "messages": [initialize]})
messages = []
deadline = time.monotonic() + 60
while not any(m.get("request_seq") == 1 for m in messages) and time.monotonic() < deadline:
    messages += dap_relay.handle("dap_poll", {"token": token, "wait": 1.0}, control)["messages"]
seen["initialize"] = [m for m in messages if m.get("request_seq") == 1]
# debugpy follows its reply with events of its own (a telemetry "output" event, which
# arrived after the reply in one run out of many): read them all before the next step.
while dap_relay.handle("dap_poll", {"token": token, "wait": 1.0}, control)["messages"]:
    pass

# Nothing from debugpy now; another control request waits: the poll gives way.
kernel.send(b"the next control request")
started = time.monotonic()
seen["gave_way"] = dap_relay.handle("dap_poll", {"token": token, "wait": 60.0}, control)
seen["gave_way_s"] = time.monotonic() - started
control.recv()

seen["stale"] = dap_relay.handle("dap_poll", {"token": "not-the-token", "wait": 0})
seen["open_before_close"] = dap_relay.is_open()
seen["closed"] = dap_relay.handle("dap_close", {"token": token})
seen["open_after_close"] = dap_relay.is_open()
# A relay its kernel stopped polling is dropped (before the rank's next cell), not before.
token = dap_relay.handle("dap_open", {"port": endpoint["port"]})["token"]
seen["kept_while_polled"] = dap_relay.drop_if_abandoned()
later = time.monotonic() + dap_relay.ABANDONED_S + 1
seen["dropped_when_abandoned"] = dap_relay.drop_if_abandoned(now=later)
seen["after_drop"] = dap_relay.handle("dap_poll", {"token": token, "wait": 0})
print("SEEN " + json.dumps(seen))
"""


def _seen() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SEEN ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return json.loads(lines[-1][5:])


def test_the_relay_carries_dap_to_the_ranks_own_debugpy_and_nothing_else():
    seen = _seen()
    # Only this process's own debugpy: the control channel is no way into other ports.
    assert "is not this rank's debugpy" in seen["other_port"], seen
    assert seen["pid_matches"]
    # The thread that serves the relay (here: the one that opened it) is one debugpy
    # neither traces nor stops.
    assert seen["traced_before_open"] is True
    assert seen["marked"] is True and seen["traced_after_open"] is False
    assert seen["sent"] == {"messages": [], "closed": False}
    (reply,) = seen["initialize"]
    assert reply["success"] and reply["command"] == "initialize", reply
    assert reply["body"].get("supportsConfigurationDoneRequest"), reply
    # A poll that waits for debugpy ends when another control request arrives.
    assert seen["gave_way"] == {"messages": [], "closed": False}, seen
    assert seen["gave_way_s"] < 60.0, seen
    assert seen["stale"] == {"messages": [], "closed": True}
    assert seen["open_before_close"] is True
    assert seen["closed"] == {"messages": [], "closed": True}
    assert seen["open_after_close"] is False
    assert seen["kept_while_polled"] is False
    assert seen["dropped_when_abandoned"] is True
    assert seen["after_drop"] == {"messages": [], "closed": True}
