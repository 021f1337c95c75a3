"""Separate process: the keeper of a named session, which owns its controller, ranks and metrics.

Run as ``python -m nbdist.launch.named_session_keeper --dir DIR --options JSON`` by
:mod:`nbdist.driver.named_sessions` (``%dist_start N --name NAME``). It detaches from
the kernel that started it: started in a session of its own (``setsid``), it
forks once more and the first process exits, so the kernel reaps that one at
once and the keeper has no parent link to the kernel. The kernel's process
group being killed (Jupyter's kernel restart), or the kernel being killed,
reaches neither the keeper nor what it started.

The keeper then starts the ranks as a kernel would (:func:`nbdist.launch.cluster.start_processes`:
the controller and the engine zygote are its children, guarded by *its*
PID, so they end when the keeper ends, even when it is killed), and runs the
session's metrics collector and run history (:class:`nbdist.metrics.hub.MetricsHub`):
the ranks' ``nbdist.log`` points arrive here whatever happens to the kernels,
so none is lost while no kernel is attached; kernels follow the run in the
history.

It writes its record (:mod:`nbdist.launch.named_session_records`), keeps the run's last
step in it, and on SIGTERM (``%dist_stop NAME`` from any kernel) closes the run,
stops every process it started, by PID, and removes the session's directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from nbdist.launch import named_session_records
from nbdist.metrics.run import Run

__all__ = ["main"]

# How often the record's last step is brought up to date (a cheap read of the run in memory).
_RECORD_EVERY_S = 1.0


class _LastSteps(Run):
    """A run that remembers each rank's last step only (its points go to the history)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: dict[int, int] = {}

    def add(self, rank, points) -> int:
        points = list(points)
        if points:
            self.steps[rank] = int(points[-1][0])
        return len(points)


class _Keeper:
    def __init__(self, folder: str, name: str, options: dict):
        self.folder, self.name, self.options = folder, name, options
        self.stop = threading.Event()
        self.record: dict = {
            "format": named_session_records.FORMAT,
            "name": name,
            "state": "starting",
            "keeper": named_session_records.pid_entry(os.getpid()),
            "uid": os.getuid(),
            "n": options.get("n"),
            "launcher": options.get("launcher") or "local",
            "started": time.time(),
            "options": options,
            "pids": [],
            "last_step": None,
        }
        self.handle = None
        self.hub = None

    def write(self, **fields) -> None:
        self.record.update(fields)
        named_session_records.write_json(
            os.path.join(self.folder, named_session_records.RECORD), self.record
        )

    def start(self) -> None:
        from nbdist.launch.cluster import start_processes
        from nbdist.launch.options import StartOptions, check_start_options
        from nbdist.launch.placement import plan_start
        from nbdist.metrics.collector import Collector
        from nbdist.metrics.hub import MetricsHub
        from nbdist.metrics.store import RunStore

        kwargs = dict(self.options)
        history = kwargs.pop("history", None)
        if kwargs.get("gpus") is not None:
            kwargs["gpus"] = tuple(kwargs["gpus"])
        opts = check_start_options(StartOptions(**kwargs))
        placement = plan_start(opts)
        self.handle = handle = start_processes(opts, placement)
        key = handle.client.session.key
        if not key:
            raise RuntimeError(
                "this cluster signs nothing (CurveZMQ): a named session needs the cluster key "
                "to authenticate metrics; start it without CurveZMQ"
            )
        # Loopback unless the ranks were asked to listen beyond it (then the controller's side).
        ip = "127.0.0.1" if opts.ip.startswith("127.") else opts.ip
        # The history is the run's only home (kernels follow it there); the keeper keeps
        # nothing but each rank's last step in memory, however long the session runs.
        store = RunStore(history if isinstance(history, str) else None)
        opened = store.new_run(world_size=placement.world_size, backend=placement.backend)
        run = _LastSteps(
            opened.id, world_size=opened.world_size, backend=opened.backend, started=opened.started
        )
        self.hub = MetricsHub(run, Collector(key, run, store, ip=ip), store)
        pids = sorted(handle.pids)
        self.write(
            state="ready",
            n=placement.world_size,
            backend=placement.backend,
            pids=[e for e in map(named_session_records.pid_entry, pids) if e],
            connection_file=handle.client_file(),
            profile_dir=handle.profile_dir,
            start_method=handle.start_method,
            start_note=handle.start_note,
            metrics_url=self.hub.url,
            run_id=self.hub.run.id,
            run_started=self.hub.run.started,
            history=self.hub.store.path if self.hub.store is not None else None,
        )

    def watch(self) -> None:
        last = None
        while not self.stop.wait(_RECORD_EVERY_S):
            step = max(self.hub.run.steps.values(), default=None)
            if step != last:
                last = step
                self.write(last_step=step)
            if self.handle.cluster is not None and not _controller_alive(self.handle):
                break  # nothing left to keep: the controller is gone

    def close(self) -> None:
        from nbdist.launch.cluster import stop_processes

        if self.record["state"] == "ready":
            try:
                self.write(state="stopping")
            except OSError:
                pass
        if self.hub is not None:
            try:
                self.hub.close()  # drains the points already on their way, ends the run
            except Exception:
                pass
        if self.handle is not None:
            stop_processes(self.handle)


def _controller_alive(handle) -> bool:
    controller = getattr(handle.cluster, "controller", None)
    pid = getattr(controller, "pid", None)
    return (
        pid is None or named_session_records.alive(named_session_records.pid_entry(pid)) is not None
    )


def main(argv: list[str] | None = None) -> int:
    """Detach, start the session, keep it until SIGTERM; the exit code."""
    import json

    parser = argparse.ArgumentParser(prog="python -m nbdist.launch.named_session_keeper")
    parser.add_argument("--dir", required=True, help="the session's record directory")
    parser.add_argument("--name", required=True)
    parser.add_argument("--options", required=True, help="JSON: the start options")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if os.fork():
        # The kernel waits for this first process only: the keeper proper is not its child.
        os._exit(0)
    # No terminal and no kernel: an interrupt or hang-up is never meant for the keeper. Caught,
    # not ignored: an ignored signal stays ignored in the controller and engines it starts.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    keeper = _Keeper(args.dir, args.name, json.loads(args.options))
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop.set())
    keeper.write()
    code = 0
    try:
        keeper.start()
        if not keeper.stop.is_set():
            keeper.watch()
    except BaseException as exc:  # the kernel waiting for the record reads why
        code = 1
        try:
            keeper.write(state="failed", error=f"{type(exc).__name__}: {exc}")
        except OSError:
            pass
        import traceback

        traceback.print_exc()
    finally:
        keeper.close()
    if code == 0 or keeper.stop.is_set():
        import shutil

        shutil.rmtree(args.dir, ignore_errors=True)  # stopped on purpose: nothing left to list
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    os._exit(main())
