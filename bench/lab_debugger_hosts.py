"""JupyterLab's debugger on ranks on other machines (relayed) against ranks on the kernel's machine (direct).

Runs in the benchmark's own process, JupyterLab's place: it speaks Jupyter's
debug protocol to two real kernels, as the front end does. One kernel's 4 ranks
run in two network namespaces (two "machines" joined by a bridge, as
tests/multihost makes them): its debugger reaches their debugpy through the
engines' control channel. The other kernel's 4 ranks run on this machine: its
debugger connects to their debugpy over TCP. The two take turns, ``--rounds``
stops each per turn, so the load of the machine falls on both alike.

Figures, per path, and relayed over direct:

- stop latency: from the rank's clock read one line above the breakpoint to its
  ``stopped`` event received here (what JupyterLab waits for);
- evaluate round trip: an Evaluate in one rank's frame, sent to answered;
- idle cost: the kernel's CPU while the debugger is attached and nothing runs.

Goal: a relayed rank's ``stopped`` event arrives well under a second after it
reaches the breakpoint (p90 under 250 ms). Needs root and ``ip`` (network
namespaces). The load average is printed too.

Usage: python bench/lab_debugger_hosts.py [--turns 2] [--rounds 5] [--idle-seconds 10]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # _common, and tests' protocol client

import ipyparallel as ipp  # noqa: E402
import psutil  # noqa: E402
from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    machine,
    print_goal_and_cpu,
    print_summary,
    run_benchmark,
)

from nbdist.driver.lab_debugger import RANKS_THREAD  # noqa: E402
from tests.conftest import terminate_in_order, wait_for_controller  # noqa: E402
from tests.debugging.test_lab_debugger import (  # noqa: E402
    LabDebugClient,
    _debugger_on,
    _select_all,
    _stack,
)
from tests.multihost.netns import Hosts, namespaces_unavailable  # noqa: E402
from tests.notebooks.conftest import Kernel  # noqa: E402

CELL = "%%on_all_ranks\nimport time\nt0 = time.time()\nx = rank\nprint('ok', x)"
BREAK_LINE = 4  # `x = rank`: t0 is read on the line above
RANKS = 4


def _run(kernel: Kernel, dbg: LabDebugClient, code: str, timeout: float = 240) -> str:
    msg_id = kernel.submit(code)
    text = dbg.cell_output(msg_id, timeout=timeout)
    reply = kernel.reply(msg_id)
    if reply["status"] != "ok":
        raise RuntimeError(f"{code!r} failed: {text} {reply}")
    return text


def _stops_received(dbg: LabDebugClient, count: int, timeout: float = 180) -> dict[int, float]:
    """When each rank's stopped event arrived here (read from IOPub without a pause)."""
    seen: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(seen)} of {count} ranks stopped")
        try:
            msg = dbg.kc.get_iopub_msg(timeout=0.01)
        except queue.Empty:
            continue
        now = time.time()
        if msg["msg_type"] != "debug_event":
            dbg.other.append(msg)
            continue
        dbg.events.append(msg["content"])
        body = msg["content"].get("body") or {}
        if msg["content"].get("event") == "stopped" and body.get("threadId") == RANKS_THREAD:
            seen[int(body["description"].split()[1])] = now
    return seen


def _round_trip(dbg: LabDebugClient, command: str, **arguments) -> tuple[float, dict]:
    dbg.seq += 1
    content = {"seq": dbg.seq, "type": "request", "command": command, "arguments": arguments}
    msg = dbg.kc.session.msg("debug_request", content)
    started = time.perf_counter()
    dbg.kc.control_channel.send(msg)
    while True:
        reply = dbg.kc.get_control_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return time.perf_counter() - started, reply["content"]


def _turn(kernel: Kernel, dbg: LabDebugClient, rounds: int, stops: list, trips: list) -> None:
    for _ in range(rounds):
        dbg.events.clear()
        msg_id = kernel.submit(CELL)
        received = _stops_received(dbg, RANKS)
        tops = _stack(dbg)
        for rank in sorted(tops):
            frame = tops[rank]["id"]
            t0 = dbg.request("evaluate", expression="repr(t0)", frameId=frame)["body"]["result"]
            stops.append(received[rank] - float(t0.strip("'")))
            for _ in range(5):
                took, reply = _round_trip(dbg, "evaluate", expression="rank", frameId=frame)
                assert reply["body"]["result"] == str(rank), reply
                trips.append(took)
        _select_all(dbg)
        dbg.request("continue", threadId=1)
        dbg.cell_output(msg_id, timeout=180)
        kernel.reply(msg_id)


def _idle_cpu(kernel: Kernel, seconds: float = 10.0) -> float:
    process = psutil.Process(kernel.pid)
    before = sum(process.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(process.cpu_times()[:2]) - before) / seconds


def _cluster(hosts: Hosts, profile: str) -> tuple[list[subprocess.Popen], str]:
    """A controller on the bridge, two engines in each namespace (as tests/multihost's two_hosts)."""
    common = [f"--profile-dir={profile}", "--cluster-id=bench"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ipyparallel.controller",
                f"--ip={hosts.bridge_address}",
                "--HeartMonitor.period=100",
                "--IPController.enable_curve=True",
                *common,
            ],
            **quiet,
        )
    ]
    client_file = os.path.join(profile, "security", "ipcontroller-bench-client.json")
    wait_for_controller(client_file)
    for index in (0, 1, 0, 1):
        engine = [sys.executable, "-m", "ipyparallel.engine", "--IPEngine.enable_nanny=False"]
        procs.append(subprocess.Popen(hosts.command(index, [*engine, *common]), **quiet))
    client = ipp.Client(client_file)
    try:
        client.wait_for_engines(RANKS, timeout=120)
    finally:
        client.close()
    return procs, client_file


def _quantiles(values: list[float]) -> dict:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "median": round(statistics.median(values) * 1000, 1),
        "p90": round(p90 * 1000, 1),
        "max": round(ordered[-1] * 1000, 1),
        "n": len(values),
    }


def _summary(values: list[float]) -> str:
    q = _quantiles(values)
    return f"median {q['median']} ms, p90 {q['p90']} ms, max {q['max']} ms (n={q['n']})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=10.0,
        help="seconds the kernel's idle CPU is read over, per path and turn (10)",
    )
    args = parser.parse_args()
    if not args.idle_seconds > 0:
        parser.error(f"--idle-seconds {args.idle_seconds:g}: give seconds > 0, e.g. 10")
    why_not = namespaces_unavailable()
    if why_not is not None:
        print(f"needs network namespaces: {why_not}", file=sys.stderr)
        return 2
    meter = CpuMeter()
    info = machine()
    print(f"machine: {info}")
    hosts = Hosts(2).create()
    procs: list[subprocess.Popen] = []
    kernels: list[Kernel] = []
    try:
        with tempfile.TemporaryDirectory() as profile:
            procs, client_file = _cluster(hosts, profile)
            relayed, direct = Kernel(), Kernel()
            kernels = [relayed, direct]
            paths = {
                "relayed": (relayed, LabDebugClient(relayed)),
                "direct": (direct, LabDebugClient(direct)),
            }
            for name, (kernel, dbg) in paths.items():
                _run(kernel, dbg, "%load_ext nbdist")
                start = f"--connect {client_file}" if name == "relayed" else str(RANKS)
                _run(kernel, dbg, f"%dist_start {start} --timeout 120 --cpu")
                _debugger_on(dbg, CELL, [{"line": BREAK_LINE}])
            stops = {name: [] for name in paths}
            trips = {name: [] for name in paths}
            idle = {name: [] for name in paths}
            for _ in range(args.turns):
                for name, (kernel, dbg) in paths.items():
                    _turn(kernel, dbg, args.rounds, stops[name], trips[name])
                    idle[name].append(_idle_cpu(kernel, args.idle_seconds))
    finally:
        for kernel in kernels:
            kernel.shutdown()
        terminate_in_order(procs)  # engines before their controller; by PID only
        hosts.remove()
    leftovers = assert_no_children()
    summary = {"machine": info, "ranks": RANKS}
    for name in paths:
        print(f"{name}: stop latency {_summary(stops[name])}")
        print(f"{name}: evaluate round trip {_summary(trips[name])}")
        cpu = ", ".join(f"{c * 100:.1f} %" for c in idle[name])
        print(f"{name}: kernel CPU while idle, debugger attached to {RANKS} ranks: {cpu}")
        summary[name] = {
            "stop_ms": _quantiles(stops[name]),
            "evaluate_ms": _quantiles(trips[name]),
            "idle_cpu_pct": [round(c * 100, 2) for c in idle[name]],
        }
    for label, found in (("stop_latency", stops), ("evaluate_round_trip", trips)):
        ratio = statistics.median(found["relayed"]) / statistics.median(found["direct"])
        print(f"relayed / direct, {label.replace('_', ' ')} (medians): {ratio:.2f}")
        summary[f"{label}_ratio"] = round(ratio, 2)
    p90 = summary["relayed"]["stop_ms"]["p90"]
    ok = p90 < 250 and not leftovers
    print_goal_and_cpu(f"relayed stop latency p90 {p90} ms < 250 ms", ok, leftovers, meter.read())
    summary["goal_met"] = ok
    summary["leftover_pids"] = leftovers
    print_summary(summary)
    # A missed goal is a figure (goal_met); only a process left behind is a failure.
    return 1 if leftovers else 0


if __name__ == "__main__":
    run_benchmark(main)
