"""Separate process: the engine zygote imports torch once, then forks one ipyparallel engine per rank.

Run as ``python -m nbdist.launch.zygote --slots JSON --parent-pid PID [...] -- ENGINE_ARGS``.

Why: ``import torch`` costs 3-4 s of CPU per process. N engines importing it
side by side on a small machine take longer than one import followed by N
forks, which share the imported pages copy-on-write.

Fork is only safe while this process has a single thread and CUDA is not
initialised (a forked child cannot use a CUDA context made by its parent).
Both are checked right before forking; if either fails, the engines are
spawned as separate processes instead and the reason is written to the status
file, which the session reports.

Children die with the zygote (PR_SET_PDEATHSIG), and the zygote ends its
children and itself when the kernel that started it disappears (its parent
pid changes), so a killed kernel leaves nothing behind.

Fast restart (SIGUSR1, sent by :mod:`nbdist.launch.restart`): the zygote ends
every process below it, as for a stop, forks a fresh engine per slot from the
same imported torch, and rewrites the status file (next ``generation``, new
PIDs). It stays single-threaded for that (no watcher thread). When every
engine ended by itself, their leftovers are ended and the zygote waits.

The zygote is a child subreaper (see :mod:`nbdist.launch.process_tree`): what
the ranks start (forked children, ``multiprocessing``, DataLoader workers,
daemons that forked twice) stays below it, and when it is asked to stop, or
its kernel is gone, it ends every process below it, engines included, by PID:
SIGTERM, then SIGKILL after 3 s. It exits once nothing is left below it.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

from nbdist.launch import process_tree
from nbdist.launch.zygote_imports import import_all

__all__ = [
    "RECORD_KINDS",
    "fork_unsafe_reason",
    "main",
    "read_crash",
    "read_exit",
    "record_exit",
]

_PR_SET_PDEATHSIG = 1
# Blocked while engines are forked; SIGUSR1 asks for a restart (fresh engines).
_MASKED = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1}
_wakeup_fds: tuple[int, int] | None = None  # the signal wakeup pipe of the zygote's loop


def _set_pdeathsig(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def fork_unsafe_reason() -> str | None:
    """Why forking engines from this process would be unsafe, or None if it is safe."""
    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    if threading.active_count() > 1:
        return f"{threading.active_count()} Python threads are running"
    try:
        native_threads = len(os.listdir("/proc/self/task"))
    except OSError:
        native_threads = 1
    if native_threads > 1:
        return f"{native_threads} native threads are running"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is already initialised in the zygote"
    return None


def _fork_engine(
    slot_env: dict[str, str], engine_argv: list[str], threads: int, status_file: str | None
) -> int:
    zygote = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    # Child. Anything raised here must not return into the zygote's loop.
    code = 1
    try:
        _set_pdeathsig()
        if os.getppid() != zygote:  # the zygote died before prctl took effect
            os._exit(1)
        _forget_zygote_signals()
        _unblock_signals()
        _record_crashes(status_file)
        os.environ.update(slot_env)
        gc.enable()  # the zygote's objects stay frozen (start_all): collections skip them
        import random

        random.seed()  # forked children would otherwise share Python's RNG state
        import torch

        torch.set_num_threads(threads)
        from ipyparallel.engine.app import IPEngine

        IPEngine.launch_instance(argv=engine_argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _unblock_signals() -> None:
    # The zygote blocks these while it forks; the mask is inherited by children.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _MASKED)


def _forget_zygote_signals() -> None:
    # A restart forks with the zygote's handlers and wakeup pipe in place: the
    # engine must not write its signals into the zygote's pipe, nor relay them.
    if _wakeup_fds is not None:
        signal.set_wakeup_fd(-1)
        for fd in _wakeup_fds:
            os.close(fd)
    for sig in _MASKED:
        signal.signal(sig, signal.SIG_DFL)


def _spawned_child_setup() -> None:
    _set_pdeathsig()
    _unblock_signals()


# A spawned engine: ipyparallel's engine (what ``python -m ipyparallel.engine`` runs), its
# crash record opened first, as a forked engine's is (argv: the status file, or "", then
# the engine's own arguments).
_SPAWNED_ENGINE = """import sys
from nbdist.launch.zygote import _record_crashes
_record_crashes(sys.argv[1])
from ipyparallel.engine.app import IPEngine
IPEngine.launch_instance(argv=sys.argv[2:])
"""


def _spawn_engine(slot_env: dict[str, str], engine_argv: list[str], status_file: str | None) -> int:
    env = dict(os.environ, **slot_env)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SPAWNED_ENGINE, status_file or "", *engine_argv],
        env=env,
        preexec_fn=_spawned_child_setup,  # noqa: PLW1509 - single-threaded or we would have forked
    )
    return proc.pid


class _Children:
    """The engines this zygote started, what is below them, and how to end it all."""

    def __init__(self, pids: list[int], status_file: str | None = None):
        self.pids = set(pids)  # the engines still running
        self.status_file = status_file  # where each engine's wait status is recorded
        self.exit_code = 0
        self.asked = False  # told to stop (SIGTERM, or the kernel is gone)
        self.restart_asked = False  # SIGUSR1: fresh engines from this zygote
        self.stopping: process_tree.TreeStop | None = None
        self.sweeping: process_tree.TreeStop | None = None  # leftovers of ranks that all ended
        self.swept = False  # ... and nothing is left of them

    def signal(self, sig: int) -> None:
        """``sig`` to every engine (the interrupt relay)."""
        for pid in list(self.pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                self.pids.discard(pid)

    def terminate(self) -> None:
        """Ask for the stop; the main loop carries it out (safe from a thread or a handler)."""
        self.asked = True

    def reap(self) -> None:
        """Collect every exited child: engines, and orphans re-parented to this subreaper."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.pids.clear()
                return
            if pid == 0:
                return
            if pid not in self.pids:
                continue  # an orphan from below a rank
            self.pids.discard(pid)
            record_exit(self.status_file, pid, status)
            code = os.waitstatus_to_exitcode(status)
            if code and not self.exit_code and not self.asked:
                self.exit_code = code if code > 0 else 128 - code

    def step(self) -> bool:
        """One pass of the main loop; False once the zygote may exit."""
        self.reap()
        if self.asked:
            if self.stopping is None:
                self.stopping = process_tree.TreeStop()
            return self.stopping.step() or bool(self.pids)
        if not self.pids and not self.swept:
            # Every engine ended by itself: what they left behind goes too, and the
            # zygote stays for a restart (or a stop).
            if self.sweeping is None:
                self.sweeping = process_tree.TreeStop()
            self.swept = not self.sweeping.step()
        return True

    def end_all(self, parent_pid: int) -> bool:
        """End every process below this one (a restart); False if a stop came meanwhile."""
        ending = process_tree.TreeStop()
        while True:
            self.reap()
            if self.asked or os.getppid() != parent_pid:
                return False
            if not ending.step() and not self.pids:
                self.exit_code = 0  # the ranks that died before belong to the last generation
                self.sweeping, self.swept = None, False
                return True
            time.sleep(0.02)


class _Forker:
    """How this zygote makes engines: every start and restart forks (or spawns) the same slots."""

    def __init__(self, opts, slots: list[dict], engine_argv: list[str], status: dict):
        self.opts, self.slots, self.engine_argv = opts, slots, engine_argv
        self.engine_env = {"OMP_NUM_THREADS": str(opts.threads)}
        self.status = status  # what the status file says besides the PIDs
        self.generation = 0

    def start_all(self, reason: str | None) -> list[int]:
        """One engine per slot, forked when ``reason`` is None (else spawned); writes the status."""
        # The caller blocks _MASKED: signals arriving while we fork would be lost
        # or hit half-built children.
        pids = []
        if reason is None:
            # Everything imported so far moves out of the collector's sight: a child's
            # collections never walk (nor write to, defeating copy-on-write) torch's
            # hundreds of thousands of objects. Python's gc docs give this recipe for fork.
            gc.freeze()
        for slot_env in self.slots:
            env = {**self.engine_env, **slot_env}
            if reason is None:
                pids.append(
                    _fork_engine(env, self.engine_argv, self.opts.threads, self.opts.status_file)
                )
            else:
                pids.append(_spawn_engine(env, self.engine_argv, self.opts.status_file))
            # A reused PID must not find an earlier process's exit status. Its crash record
            # the engine itself opens anew, emptied (a forked one has already; removing it
            # here could take a spawned one's from under it).
            _forget_record(self.opts.status_file, "exit", pids[-1])
        _write_status(
            self.opts.status_file,
            **self.status,
            method="fork" if reason is None else "spawn",
            reason=reason,
            pids=pids,
            zygote=os.getpid(),
            generation=self.generation,
        )
        return pids

    def restart(self, children: _Children) -> None:
        """The old engines and their leftovers ended, fresh ones forked: the next generation."""
        children.restart_asked = False
        if not children.end_all(self.opts.parent_pid):
            return  # a stop came first: the main loop finishes it
        self.generation += 1
        reason = "spawn requested" if self.opts.start_method == "spawn" else fork_unsafe_reason()
        signal.pthread_sigmask(signal.SIG_BLOCK, _MASKED)
        try:
            children.pids = set(self.start_all(reason))
        finally:
            _unblock_signals()


def _watch_loop(children: _Children, forker: _Forker, wakeup: int) -> None:
    # Polling the parent pid costs nothing measurable and, unlike PDEATHSIG,
    # does not depend on which thread of the kernel started us. No thread does it:
    # a restart forks again, which needs this process single-threaded.
    while children.step():
        if os.getppid() != forker.opts.parent_pid:
            children.terminate()
        elif children.restart_asked and not children.asked:
            forker.restart(children)
            continue
        # A signal (SIGUSR1, SIGTERM) writes to the wakeup pipe: handled at once.
        if select.select([wakeup], [], [], 0.1)[0]:
            try:
                os.read(wakeup, 512)
            except BlockingIOError:
                pass
    children.reap()


def record_exit(status_file: str | None, pid: int, status: int) -> None:
    """Keep an engine's wait status where the kernel finds it (:func:`read_exit`).

    The kernel reads a dead rank's status from its zombie; this zygote may reap
    the zombie first (its loop wakes every 0.1 s), so it writes the status too.
    """
    if status_file:
        try:
            _write_atomically(_record_file(status_file, "exit", pid), str(status))
        except OSError:
            pass


def read_exit(status_file: str, pid: int) -> int | None:
    """The wait status :func:`record_exit` kept for ``pid`` (None if none yet)."""
    try:
        with open(_record_file(status_file, "exit", pid)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


# Each engine's records, beside the status file: "exit" (its wait status, record_exit) and
# "crash" (faulthandler's dump, _record_crashes). local_engines removes both at stop.
RECORD_KINDS = ("exit", "crash")


def _record_file(status_file: str, kind: str, pid: int) -> str:
    return f"{status_file}.{kind}.{pid}"


def _forget_record(status_file: str | None, kind: str, pid: int) -> None:
    if status_file:
        try:
            os.remove(_record_file(status_file, kind, pid))
        except OSError:
            pass


_crash_log = None  # the open file faulthandler writes to: it must stay open while the rank runs


def _record_crashes(status_file: str | None) -> None:
    # In the engine (forked or spawned): where a fatal signal (a segmentation fault in native code,
    # SIGABRT, SIGBUS, ...) leaves the Python stack of every thread, for the kernel
    # (read_crash). The rank's stderr is shared by all ranks and not read by the kernel.
    global _crash_log
    if not status_file:
        return
    import faulthandler

    try:
        _crash_log = open(_record_file(status_file, "crash", os.getpid()), "w")  # noqa: SIM115
    except OSError:
        return
    faulthandler.enable(file=_crash_log, all_threads=True)
    # A child the rank forks (a DataLoader worker) would inherit the handler and write its
    # own crash into the rank's record: it gets none.
    os.register_at_fork(after_in_child=faulthandler.disable)


def read_crash(status_file: str, pid: int) -> str:
    """What faulthandler wrote when engine ``pid`` died of a fatal signal ('' if nothing).

    Its last 64 KiB: the end of the last dump, the one of the rank's death.
    """
    try:
        with open(_record_file(status_file, "crash", pid), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _write_atomically(path: str, text: str) -> None:
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def _write_status(path: str | None, **fields) -> None:
    if path:
        _write_atomically(path, json.dumps(fields))


def main(argv: list[str] | None = None) -> int:
    """Fork (or spawn) the engines, then watch them until asked to stop; the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        own, engine_argv = argv[:split], argv[split + 1 :]
    else:
        own, engine_argv = argv, []
    parser = argparse.ArgumentParser(prog="python -m nbdist.launch.zygote")
    parser.add_argument("--slots", required=True, help="JSON list of per-engine environments")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--status-file", default=None)
    opts = parser.parse_args(own)
    slots = json.loads(opts.slots)

    # With more than one OpenMP thread, importing torch starts a native thread,
    # and a process with threads must not fork. So the zygote imports torch
    # single-threaded; each engine gets its thread count after the fork.
    os.environ["OMP_NUM_THREADS"] = "1"
    # Signals arriving while we fork would be lost or hit half-built children. SIGTERM
    # only from the first fork on: until then there is nothing to end but the zygote,
    # and a start stopped (a failed or interrupted %dist_start) while it imports torch
    # waited for ipyparallel's SIGKILL, 5 s later and with a warning in the cell.
    signal.pthread_sigmask(signal.SIG_BLOCK, _MASKED - {signal.SIGTERM})
    reason = "spawn requested" if opts.start_method == "spawn" else None
    if reason is None:
        # No cyclic collections while importing: each full one walks every object torch
        # made so far, and the imports trigger several (~0.15 s of a 2-rank start on
        # 2 cores). start_all freezes what was imported, the children collect again.
        gc.disable()
        import_all(len(slots))
        reason = fork_unsafe_reason()
    signal.pthread_sigmask(signal.SIG_BLOCK, _MASKED)
    # Before the first fork: orphans from below the ranks are re-parented here, not to PID 1.
    subreaper = process_tree.become_subreaper()
    forker = _Forker(opts, slots, engine_argv, {"subreaper": subreaper})
    children = _Children(forker.start_all(reason), opts.status_file)
    gc.enable()  # in the zygote too, now that its imports are frozen

    global _wakeup_fds
    _wakeup_fds = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(_wakeup_fds[1])
    signal.signal(signal.SIGTERM, lambda *_: children.terminate())
    # SIGINT is the interrupt relay: forwarded, never fatal to the zygote.
    signal.signal(signal.SIGINT, lambda *_: children.signal(signal.SIGINT))
    signal.signal(signal.SIGUSR1, lambda *_: setattr(children, "restart_asked", True))
    _unblock_signals()
    _watch_loop(children, forker, _wakeup_fds[0])
    # Asked to stop (%dist_stop, a full restart): a success, even if a rank had died
    # before; otherwise ipyparallel logs the engines' whole output as a warning in
    # the notebook, on top of nbdist's own report of the dead rank.
    return 0 if children.asked else children.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A normal exit after importing torch spends ~0.8 s tearing the interpreter
    # down; the zygote holds nothing that needs it, and stop() waits for it.
    os._exit(code)
