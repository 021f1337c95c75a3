"""What the late-output tap costs on ipyparallel's IO thread, per IOPub message.

nbdist taps the client's IOPub stream (``nbdist.driver.ipp_internals.tap_late_iopub``)
so that what ranks print after their request ended is shown instead of kept for good.
Every message of every cell now passes the tap. On one real 2-rank CPU session, signed
stream messages are handed to the IO thread's callback, interleaved in every round:

- cell, raw:     a message of a request still running, ipyparallel's own handler (the baseline)
- cell, tapped:  the same kind of message through the tap (what every cell's output takes)
- late, raw:     a message of a request that has ended: ipyparallel appends it to a
                 metadata entry no one reads (the text it kept is reported)
- late, tapped:  the same through the tap: freed, folded, printed (to a buffer here)

Each message is signed and used once (a session refuses a signature it saw). The
figure is the ratio of the medians of µs per message (goal: the tap adds at most 5 %
to a cell's message). The late paths' printing happens after the timed loop, on the IO
thread's next turns, and is not in the figure.

The tap comes out cheaper than ipyparallel's own handler: that one is wrapped by the
``decorator`` package, whose wrapper binds each call's arguments to the signature
(``inspect.Signature.bind``, decorator 5.x); the tap calls the function under it.

Usage: python bench/late_output.py [--messages 4000] [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    CpuMeter,
    assert_no_children,
    balanced_orders,
    conclude,
    machine,
    median,
    ratio,
    run_benchmark,
)

GOAL = 1.05
PATHS = ["cell raw", "cell tapped", "late raw", "late tapped"]


def _frames(client, msg_ids: list[str], n: int, tag: str) -> list[list]:
    """``n`` signed stream messages, each as the frames the IO thread receives, round robin
    over ``msg_ids`` as their parents."""
    import zmq

    session = client.session
    out = []
    for i in range(n):
        parent = {
            "msg_id": msg_ids[i % len(msg_ids)],
            "session": session.session,
            "msg_type": "execute_request",
            "username": session.username,
            "date": "",
            "version": "5.3",
        }
        msg = session.msg("stream", {"name": "stdout", "text": f"{tag} line {i}\n"}, parent=parent)
        out.append([zmq.Frame(part) for part in session.serialize(msg)])
    return out


def _timed_on_io_thread(client, callback, batch: list) -> float:
    """Seconds ``callback`` took over ``batch``, run on the client's IO thread."""
    done = threading.Event()
    took = []

    def job() -> None:
        t0 = time.perf_counter()
        for parts in batch:
            callback(parts)
        took.append(time.perf_counter() - t0)
        done.set()

    client._io_loop.add_callback(job)  # noqa: SLF001
    if not done.wait(600):
        raise TimeoutError("the IO thread did not run the batch")
    return took[0]


def _main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=4000, help="messages per path and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1000 messages, 3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.messages, args.rounds = 1000, 3

    import nbdist
    from nbdist.driver.ipp_internals import per_engine_futures
    from nbdist.driver.sinks import ListSink

    info = machine()
    cpu_meter = CpuMeter()
    per_message: dict[str, list[float]] = {path: [] for path in PATHS}
    with nbdist.DistSession(2, cpu=True, history=False) as session:
        client = session.client
        # A finished cell (its requests are the late output's) and a running one.
        ended = session.run("pass", block=False, sink=ListSink())
        ended_ids = [child.msg_id for child in per_engine_futures(ended._ar)]  # noqa: SLF001
        ended.wait()
        running = client[list(client.ids)].execute("import time; time.sleep(3600)", block=False)
        running_ids = list(running.msg_ids)
        tapped = client._iopub_stream._recv_callback  # noqa: SLF001
        assert getattr(tapped, "__name__", "") == "on_recv", f"not nbdist's tap: {tapped!r}"
        raw = client._dispatch_iopub  # noqa: SLF001 - ipyparallel's own handler
        callbacks = {
            "cell raw": raw,
            "cell tapped": tapped,
            "late raw": raw,
            "late tapped": tapped,
        }
        parents = {
            "cell raw": running_ids,
            "cell tapped": running_ids,
            "late raw": ended_ids,
            "late tapped": ended_ids,
        }
        kept_raw = 0
        orders = balanced_orders(PATHS)
        with contextlib.redirect_stdout(io.StringIO()):
            for r in range(args.rounds + 1):  # the first round warms up
                for path in orders[r % len(orders)]:
                    batch = _frames(client, parents[path], args.messages, f"{path} {r}")
                    # ipyparallel appends each line to the running request's text: every batch
                    # starts from none, or later batches would pay for a longer string.
                    for m in running_ids:
                        client.metadata[m]["stdout"] = None
                    took = _timed_on_io_thread(client, callbacks[path], batch)
                    if r:
                        per_message[path].append(took / args.messages * 1e6)
                    if path == "late raw":
                        kept_raw = max(
                            kept_raw,
                            sum(len(client.metadata[m]["stdout"] or "") for m in ended_ids),
                        )
                        for m in ended_ids:
                            client.metadata.pop(m, None)
                time.sleep(0.3)  # the late lines' printing (WINDOW_S) happens here
            kept_tapped = sum(
                len((client.metadata.get(m) or {}).get("stdout") or "") for m in ended_ids
            )
        session.interrupt()
        with contextlib.suppress(Exception):
            running.get(30)
    cpu = cpu_meter.read()
    leftovers = assert_no_children()

    medians = {path: median(values) for path, values in per_message.items()}
    print(f"{args.messages} messages x {args.rounds} rounds per path, 2 CPU ranks")
    print(f"{'path':<14} {'median µs/msg':>14} {'min':>8} {'max':>8}")
    for path in PATHS:
        values = per_message[path]
        print(f"{path:<14} {medians[path]:>14.2f} {min(values):>8.2f} {max(values):>8.2f}")
    cell_ratio = ratio(medians["cell tapped"], medians["cell raw"])
    late_ratio = ratio(medians["late tapped"], medians["late raw"])
    print(f"cell message: tapped / raw = {cell_ratio:.3f}")
    print(f"late message: tapped / raw = {late_ratio:.3f}")
    print(
        f"late text kept by ipyparallel: raw {kept_raw} characters after one round, "
        f"tapped {kept_tapped}"
    )
    ok = cell_ratio <= GOAL
    goal = f"the tap costs a cell's message <= {GOAL}x ipyparallel's own handling"
    extra = dict(
        messages=args.messages,
        rounds=args.rounds,
        us_per_message=medians,
        cell_ratio=cell_ratio,
        late_ratio=late_ratio,
        late_kept_raw=kept_raw,
        late_kept_tapped=kept_tapped,
    )
    conclude("late_output", goal, GOAL, ok, leftovers, cpu, info, args.quick, **extra)
    return 0


if __name__ == "__main__":
    run_benchmark(_main)
