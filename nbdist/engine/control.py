"""Rank side: hang diagnosis and release, answered while the rank is busy.

A rank blocked in a collective cannot run a cell, and SIGINT does not land
while it waits in native code (gloo measured: 58.8 s, the group's timeout).
So nbdist answers its requests on the engine's *control* channel, which
ipykernel serves on its own thread (the one that also serves
``signal_request``), HMAC-signed like every ipyparallel message:

``where``
    this rank's Python stack (main thread, from the cell's frame down) and
    the last collective it entered (:mod:`nbdist.engine.collectives`).
``collective``
    only whether a cell runs and the last collective: what the cell guard
    asks every few seconds of a long cell (no stack text, no flight recorder).
``dap_open``, ``dap_send``, ``dap_poll``, ``dap_close``
    JupyterLab's debugger on a rank the kernel cannot connect to (another
    machine): the Debug Adapter Protocol relayed to the rank's debugpy on
    its loopback (:mod:`nbdist.engine.dap_relay`).
``lab_prepare``, ``lab_paused``
    JupyterLab's debugger on any rank: attach its debugpy and announce the
    cell (bounded, answered while an earlier cell runs), and whether its main
    thread is paused at a breakpoint (:mod:`nbdist.engine.dap_relay`).
``crash_record``
    read (or, with ``remove``, remove) a crash record on this rank's machine:
    another rank's, one that died (:mod:`nbdist.engine.crash_record`); with
    ``remove_own``, this rank's own, at the stop.
``interrupt``
    stop one request if the kernel's SIGINT came before this rank began it
    (:mod:`nbdist.engine.late_interrupt`).
``caught``
    what the request this rank runs did with the interrupt's KeyboardInterrupt:
    caught it and runs on (its ``except``/``finally`` code; not paused in debugpy,
    which swallows it), the request runs outside the user's code (reporting an error),
    or there is no request any more
    (:func:`nbdist.engine.late_interrupt.interrupt_answer`).
``release``
    break this rank out of the collective it waits in. NCCL: abort the
    communicators (``_abort_process_group``). gloo has no abort (its
    ``abort()`` is a no-op in torch 2.13), so nbdist shuts down the group's
    own TCP sockets, remembered when the group formed: the blocked wait
    then fails at once with "Connection closed". The process, its
    variables and its models stay; the group must be formed again
    (:func:`nbdist.engine.bootstrap.rejoin`).
``end_if_held``
    end this rank if a call it was in when released still holds it (gloo
    leaves a queued send, or a receive halfway through its data, waiting
    until the group's timeout: :mod:`nbdist.engine.held_collective`).

Blocking waits release the GIL, so the control thread runs while the main
thread waits. A rank stuck in native code that holds the GIL does not answer;
the kernel side reports that instead of waiting.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import traceback

from nbdist.engine import (
    collectives,
    crash_record,
    dap_relay,
    flight_recorder,
    held_collective,
    late_interrupt,
)
from nbdist.engine.helpers import device, rank
from nbdist.metrics.gpu import read_this_rank

__all__ = [
    "collective_state",
    "gpu",
    "gloo_connects_lazily",
    "group_sockets",
    "install",
    "main_busy",
    "release",
    "remember_group_sockets",
    "runs_cell",
    "track_subgroups",
    "where",
]

REQUEST = "nbdist_request"
REPLY = "nbdist_reply"

# (fd, inode) of the sockets the process group opened; inode-checked before use
# so that a reused fd number is never touched.
_group_sockets: set[tuple[int, str]] = set()
_released = False


def _socket_fds() -> set[tuple[int, str]]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            found.add((int(name), target))
    return found


def socket_snapshot() -> set[tuple[int, str]]:
    """The sockets open now; diff two snapshots to find what a step opened."""
    return _socket_fds() if os.path.isdir("/proc/self/fd") else set()


def remember_group_sockets(opened: set[tuple[int, str]]) -> None:
    """Record the sockets the group opened (rendezvous store and gloo pairs)."""
    global _released
    _group_sockets.clear()
    _group_sockets.update(opened)
    _released = False
    held_collective.forget_release()


def track_subgroups() -> None:
    """Remember the sockets of groups made later (``dist.new_group``, a DeviceMesh) too (idempotent).

    Every subgroup is built by ``distributed_c10d._new_process_group_helper``,
    looked up in its module at each call, so wrapping it there sees them all.
    """
    from torch.distributed import distributed_c10d as c10d

    # torch has no public hook for "a group was made"; this private helper is where they all pass.
    helper = c10d._new_process_group_helper  # noqa: SLF001
    if hasattr(helper, "nbdist_original"):
        return

    def remembering(*args, **kwargs):
        before = socket_snapshot()
        try:
            return helper(*args, **kwargs)
        finally:
            _group_sockets.update(socket_snapshot() - before)

    remembering.nbdist_original = helper
    c10d._new_process_group_helper = remembering  # noqa: SLF001


def gloo_connects_lazily() -> bool:
    """Whether this rank's gloo groups connect their ranks at first use (``TORCH_GLOO_LAZY_INIT``).

    :func:`release` shuts down the sockets a group opened while it formed; a lazily
    connected group opens its ranks' connections later, inside collectives, where
    nobody records them (those of its first all-reduce, made while it forms, are): a
    subgroup's all-reduce hung past 300 s, unreleased. What lazy connections save: 256
    ranks on 2 cores formed the group 7 s faster, with ~240 fewer sockets a rank.
    Truthy as torch reads its boolean variables.
    """
    value = os.environ.get("TORCH_GLOO_LAZY_INIT", "")
    return value.strip().lower() in {"1", "true", "yes", "y", "on"}


def group_sockets() -> set[tuple[int, str]]:
    """The (fd, inode) of the sockets remembered for the group: what :func:`release` shuts down."""
    return set(_group_sockets)


def released() -> bool:
    """True once :func:`release` ran since the group formed: it must be formed again."""
    return _released


def release() -> dict:
    """Make every collective this rank waits in fail now; returns what was done."""
    global _released
    import torch.distributed as dist

    _released = True
    held_collective.mark_released()
    if not dist.is_initialized():
        return {"action": "none", "detail": "no process group"}
    backend = dist.get_backend()
    if backend == "nccl":
        # NCCL has a real abort; it also ends the communicators' watchdog waits.
        # The abort torch itself uses on a watchdog timeout; not public API yet.
        dist.distributed_c10d._abort_process_group()  # noqa: SLF001
        return {"action": "abort", "detail": "nccl communicators aborted"}
    current = _socket_fds()
    closed = 0
    for entry in _group_sockets & current:
        try:
            # A dup shares the open file description: shutdown() on it wakes
            # gloo's blocked reads with EOF; closing only the dup leaves gloo's
            # own fd valid (no fd number is freed under gloo's feet).
            dup = socket.socket(fileno=os.dup(entry[0]))
        except OSError:
            continue
        try:
            # Listening sockets stay: gloo's listener thread aborts the whole
            # process when accept() fails.
            if not dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                dup.shutdown(socket.SHUT_RDWR)
                closed += 1
        except OSError:
            pass
        finally:
            dup.close()
    return {"action": "shutdown", "detail": f"{closed} group sockets shut down"}


def runs_cell(name: str, filename: str) -> bool:
    """Whether a frame of function ``name`` in ``filename`` is IPython's run_code, which runs
    a cell's code (the rank's own stacks here, a crash record's in the kernel)."""
    return name == "run_code" and "interactiveshell" in filename


def _cell_frames(frame) -> list:
    """The main thread's frames from the user's cell down (innermost last)."""
    stack = traceback.extract_stack(frame)
    start = None
    for i, entry in enumerate(stack):
        if runs_cell(entry.name, entry.filename):
            start = i + 1
    if start is None:
        for i, entry in enumerate(stack):  # apply requests: ipyparallel's do_apply
            if entry.name == "do_apply":
                start = i + 1
    frames = [] if start is None else stack[start:]
    # nbdist's own wrapper around each collective is noise in a user's stack.
    return [
        f
        for f in frames
        if not f.filename.endswith(os.path.join("nbdist", "engine", "collectives.py"))
    ]


def where() -> dict:
    """This rank's main-thread stack (from the cell down) and last collective."""
    main = threading.main_thread()
    # The record first, then the stack: read the other way round, a rank entering a
    # collective showed the record inside it and the stack still on the line before.
    last = collectives.last()
    # The only way to read another thread's stack (the control thread reads the main one).
    frame = sys._current_frames().get(main.ident)  # noqa: SLF001
    frames = _cell_frames(frame) if frame is not None else []
    return {
        "rank": rank(),
        "pid": os.getpid(),
        "busy": bool(frames),
        "stack": [
            {"file": f.filename, "line": f.lineno, "name": f.name, "code": (f.line or "").strip()}
            for f in frames
        ],
        "collective": last,
        # The group's own record (C++-issued collectives too: DDP buckets, FSDP gathers).
        "flight": flight_recorder.recent(),
        "released": _released,
    }


def main_busy() -> bool:
    """Whether the main thread runs a cell or an apply (walking its frames: microseconds)."""
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001
    while frame is not None:
        code = frame.f_code
        if runs_cell(code.co_name, code.co_filename) or code.co_name == "do_apply":
            return True
        frame = frame.f_back
    return False


def collective_state(flight: bool = False) -> dict:
    """Whether the main thread runs a cell or an apply, and this rank's last collective.

    The cell guard's periodic look: walking the main thread's frames for the
    cell's entry costs microseconds, where :func:`where` renders the stack and
    reads the flight recorder. ``flight``: also the default group's state in the
    flight recorder (:func:`nbdist.engine.flight_recorder.default_group_state`),
    unless the rank waits in a collective nbdist records already.
    """
    busy = main_busy()
    last = collectives.last()
    # The call this rank has stayed in since its release, and how long (None: none).
    state = {"busy": busy, "collective": last, "held": held_collective.held(busy)}
    if flight and not (last and last["inside"]):
        state["flight_state"] = flight_recorder.default_group_state()
    return state


def gpu() -> dict | None:
    """The figures of this rank's GPU (cached up to a second), None when its device is not CUDA.

    Read on the control thread, whose current CUDA device is not the rank's:
    the rank's device is named explicitly.
    """
    mine = device()
    if mine.type != "cuda":
        return None
    return read_this_rank(mine.index or 0)


def _handle(kernel, stream, idents, parent) -> None:
    content = parent.get("content", {})
    action = content.get("action")
    try:
        if action == "where":
            reply = {"status": "ok", "where": where()}
        elif action == "collective":
            reply = {"status": "ok", "where": collective_state(bool(content.get("flight")))}
        elif action == "release":
            reply = {"status": "ok", "release": release()}
        elif action == "end_if_held":
            # Returns only where the rank left its collective meanwhile: else it exits.
            min_s = float(content.get("min_s", held_collective.HELD_S))
            ended = held_collective.end_if_held(min_s, main_busy())
            reply = {"status": "ok", "ended": ended}
        elif action == "gpu":
            reply = {"status": "ok", "gpu": gpu()}
        elif action == "interrupt":
            done = late_interrupt.interrupt_request(
                kernel,
                str(content.get("msg_id", "")),
                content.get("since"),
                str(content.get("boot", "")),
            )
            reply = {"status": "ok", "interrupt": done}
        elif action == "caught":
            # A rank paused in debugpy caught nothing: debugpy swallows the KeyboardInterrupt.
            answer = "" if dap_relay.main_thread_paused() else late_interrupt.interrupt_answer()
            reply = {"status": "ok", "answer": answer}
        elif action == "crash_record":
            path = str(content.get("path", ""))
            if content.get("remove_own"):  # the session stops: this rank's own record goes
                crash_record.remove_own_record()
                reply = {"status": "ok", "removed": True}
            elif content.get("remove"):
                reply = {"status": "ok", "removed": crash_record.remove_record(path)}
            else:
                reply = {"status": "ok", "record": crash_record.read_record(path)}
        elif action in dap_relay.ACTIONS:
            # JupyterLab's debugger, relayed to this rank's debugpy (a kernel on another machine).
            found = dap_relay.handle(action, content, getattr(stream, "socket", None))
            reply = {"status": "ok", "dap": found}
        else:
            reply = {"status": "error", "ename": "ValueError", "evalue": f"unknown {action!r}"}
    except Exception as exc:  # the reply must go out whatever happened
        reply = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
    kernel.session.send(stream, REPLY, content=reply, parent=parent, ident=idents)


def install(kernel) -> None:
    """Serve nbdist's control requests on this engine's ``kernel`` (idempotent).

    ``kernel``: the engine's ipykernel kernel (``get_ipython().kernel``), handed in
    by :func:`nbdist.engine.bootstrap.init_rank`.
    """
    kernel.control_handlers[REQUEST] = lambda stream, idents, parent: _handle(
        kernel, stream, idents, parent
    )
