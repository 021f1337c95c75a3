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
step in it and since when the session is idle (no kernel attached, no cell
running on a rank: ``idle_since``); a session started with ``--idle-timeout``
ends itself once idle that long. On SIGTERM (``%dist_stop NAME`` from any kernel) closes the run,
stops every process it started, by PID, and removes the session's directory.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from nbdist.errors import NbdistError
from nbdist.launch import named_session_records, process_tree
from nbdist.metrics.run import Run

__all__ = ["main"]

# How often the record's last step is brought up to date (a cheap read of the run in memory).
_RECORD_EVERY_S = 1.0
# How often the keeper asks the controller whether a cell runs (one small request).
_IDLE_CHECK_EVERY_S = 2.0
# The kernel that started the session attaches a moment after the ranks are up: until
# it did (or this long), the session is in use, so a short --idle-timeout cannot end it first.
_FIRST_ATTACH_GRACE_S = 30.0


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
            "keeper": process_tree.pid_entry(os.getpid()),
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
        self.ready_at = None  # monotonic time the ranks were up

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
        kwargs.pop("idle_timeout", None)
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
            gpus=sorted({s.gpu for s in placement.slots if s.gpu is not None}),
            pids=[e for e in map(process_tree.pid_entry, pids) if e],
            connection_file=handle.client_file(),
            # Where an attaching kernel reads how a rank died while no kernel held it.
            zygote_status=handle.zygote_status_file(),
            profile_dir=handle.profile_dir,
            start_method=handle.start_method,
            start_note=handle.start_note,
            metrics_url=self.hub.url,
            run_id=self.hub.run.id,
            run_started=self.hub.run.started,
            history=self.hub.store.path if self.hub.store is not None else None,
        )

    def watch(self) -> None:
        self.ready_at = time.monotonic()
        last, checked = None, 0.0
        while not self.stop.wait(_RECORD_EVERY_S):
            step = max(self.hub.run.steps.values(), default=None)
            if step != last:
                last = step
                self.write(last_step=step)
            if self.handle.cluster is not None and not _controller_alive(self.handle):
                break  # nothing left to keep: the controller is gone
            if time.monotonic() - checked >= _IDLE_CHECK_EVERY_S:
                checked = time.monotonic()
                if self.idle_for_too_long():
                    break

    def idle_for_too_long(self) -> bool:
        """Note since when no kernel is attached and no cell runs; True once past ``idle_timeout``."""
        attached = bool(named_session_records.attached_kernels(self.name))
        # The folder of attached kernels stays once the first one made it.
        ever = os.path.isdir(os.path.join(self.folder, named_session_records.ATTACHED))
        waiting = time.monotonic() - self.ready_at < _FIRST_ATTACH_GRACE_S
        in_use = attached or (waiting and not ever)
        in_use = in_use or _cells_running(self.handle.client)
        since = self.record.get("idle_since")
        if in_use and since is not None:
            self.write(idle_since=None)
        elif not in_use and since is None:
            self.write(idle_since=time.time())
        limit = self.options.get("idle_timeout")
        since = self.record.get("idle_since")
        if limit and since is not None and time.time() - since >= limit:
            self.write(error=f"ended after {limit:g} s idle (--idle-timeout)")
            return True
        return False

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


def _cells_running(client) -> bool:
    # A cell counts from the moment it is queued on an engine until its reply: one that an
    # earlier kernel left running (it died mid-cell) keeps the session in use.
    try:
        status = client.queue_status()
    except Exception:  # a controller that does not answer: not idle, the watch ends it
        return True
    return bool(status.get("unassigned")) or any(
        isinstance(v, dict) and (v.get("queue") or v.get("tasks")) for v in status.values()
    )


def _controller_alive(handle) -> bool:
    controller = getattr(handle.cluster, "controller", None)
    pid = getattr(controller, "pid", None)
    return pid is None or process_tree.alive(process_tree.pid_entry(pid)) is not None


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
        # nbdist's own errors say what happened and the fix; anything else shows its type,
        # and its traceback goes to the keeper's log.
        expected = isinstance(exc, NbdistError)
        try:
            keeper.write(
                state="failed", error=str(exc) if expected else f"{type(exc).__name__}: {exc}"
            )
        except OSError:
            pass
        if not expected:
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
