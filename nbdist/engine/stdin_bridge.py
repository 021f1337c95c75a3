"""Rank side: ``input()``, ``getpass`` and pdb on a rank, answered in the notebook through Jupyter's stdin.

An engine has no stdin of its own (ipykernel's ``raw_input`` raises
``StdinNotImplementedError`` there). :func:`install` gives the engine's kernel
a ``raw_input`` and a ``getpass`` of nbdist's, which ipykernel puts in
``builtins.input`` and ``getpass.getpass`` for every execute request. Each call:

1. flushes the rank's stdout and stderr, so that pdb's listing reaches the
   cell before the prompt;
2. publishes an ``nbdist_input_request`` (prompt, rank, an id) on the engine's
   IOPub channel with the running cell as parent: it reaches the kernel's
   waiting loop (:class:`nbdist.driver.runner.RankRun`) the way the cell's
   output does, after that output, HMAC-signed like it;
3. blocks until the kernel sends the answer as an ``nbdist_input_reply`` on
   the engine's control channel, which ipykernel serves on its own thread
   while the main thread waits here (signed like every ipyparallel message).

The kernel asks its own front end (the notebook's input box) and serves the
ranks' prompts one at a time. Its answer is a line, an end of file, "this
front end has no stdin" (:class:`NoStdinError` is raised here at once), or
"the cell was interrupted" (``KeyboardInterrupt``).

``pdb.Pdb`` becomes :class:`RankPdb`, so ``breakpoint()``, ``pdb.set_trace()``
and ``pdb.post_mortem()`` use it: its prompt names the rank (``(Pdb rank 1)``)
and SIGINT stays nbdist's interrupt. Plain pdb would, after ``c``, catch the
next Ctrl-C and stop in the debugger again, and at its prompt it answers
Ctrl-C by asking again: the interrupt must end the cell on every rank instead.
"""

from __future__ import annotations

import bdb
import pdb
import queue
import sys
import uuid

from nbdist.engine.helpers import rank

__all__ = [
    "INPUT_REPLY",
    "INPUT_REQUEST",
    "NoStdinError",
    "RankPdb",
    "StdinBridge",
    "install",
    "labelled_prompt",
    "post_mortem",
]

INPUT_REQUEST = "nbdist_input_request"  # rank -> kernel, on IOPub
INPUT_REPLY = "nbdist_input_reply"  # kernel -> rank, on the control channel
_ACK = "nbdist_input_ack"
# How often the waiting main thread wakes up: signal handlers (SIGINT) run in between.
_WAKE_S = 0.2


class NoStdinError(RuntimeError):
    """A rank asked for input, and the notebook's front end sends none (a headless run)."""


class _Interrupted(BaseException):
    """Carries a KeyboardInterrupt past pdb's own ``except KeyboardInterrupt`` at its prompt."""


_PdbBase = pdb.Pdb  # the standard debugger, before install() replaces the module's name


class RankPdb(_PdbBase):
    """pdb whose prompt names the rank and which leaves SIGINT to nbdist's interrupt."""

    def __init__(self, *args, **kwargs):
        """As :class:`pdb.Pdb`, with ``nosigint=True`` and the prompt ``(Pdb rank N)``."""
        kwargs["nosigint"] = True
        super().__init__(*args, **kwargs)
        self.prompt = f"(Pdb rank {rank()}) "

    def trace_dispatch(self, frame, event, arg):
        """bdb's tracer. What ends the cell from the prompt is raised afresh here, without
        pdb's own frames: ``q`` as a BdbQuit that says so (bdb's says nothing), an
        interrupt, or a front end without stdin."""
        try:
            return super().trace_dispatch(frame, event, arg)
        except bdb.BdbQuit as exc:
            if exc.args:
                raise
            raise bdb.BdbQuit(
                f"pdb was quit (q) on rank {rank()}: the cell was ended there (c resumes instead)"
            ) from None
        except (KeyboardInterrupt, NoStdinError) as exc:
            raise type(exc)(*exc.args) from None

    def cmdloop(self, intro=None):
        """Read commands; Ctrl-C (the kernel's interrupt) leaves the debugger instead of asking again."""
        try:
            return super().cmdloop(intro)
        except KeyboardInterrupt:
            raise _Interrupted from None

    def interaction(self, frame, traceback):
        """Stop at ``frame``; an interrupt at the prompt ends the cell on this rank."""
        try:
            return super().interaction(frame, traceback)
        except _Interrupted:
            self.set_quit()
            raise KeyboardInterrupt(f"interrupted at the pdb prompt on rank {rank()}") from None


def labelled_prompt(prompt: str, rank_number: int) -> str:
    """``prompt`` as the notebook shows it: with the rank's label unless it names the rank already."""
    prompt = str(prompt)
    if f"rank {rank_number}" in prompt:
        return prompt
    return f"[rank {rank_number}] {prompt}"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


class StdinBridge:
    """One engine's ``input``/``getpass``: ask the kernel over IOPub, wait for its control reply."""

    def __init__(self, kernel):
        """Bridge for ``kernel``, the engine's ipykernel kernel (``get_ipython().kernel``)."""
        self.kernel = kernel
        self._answers: queue.Queue = queue.Queue()

    def input(self, prompt: str = "") -> str:
        """``builtins.input`` on this rank: the line typed in the notebook."""
        return self.ask(prompt, password=False)

    def getpass(self, prompt: str = "Password: ", stream=None, **_ignored) -> str:
        """``getpass.getpass`` on this rank: typed in the notebook's password box."""
        return self.ask(prompt, password=True)

    def ask(self, prompt: str, *, password: bool) -> str:
        """Send ``prompt`` to the kernel and block until it answers."""
        _flush()
        while True:  # answers to earlier prompts that were given up (interrupted) are stale
            try:
                self._answers.get_nowait()
            except queue.Empty:
                break
        request_id = uuid.uuid4().hex
        me = rank()
        kernel = self.kernel
        kernel.session.send(
            kernel.iopub_socket,
            INPUT_REQUEST,
            content={
                "id": request_id,
                "prompt": labelled_prompt(prompt, me),
                "password": bool(password),
                "rank": me,
            },
            parent=kernel.get_parent("shell"),
            ident=f"engine.{getattr(kernel, 'engine_id', '')}.{INPUT_REQUEST}".encode(),
        )
        while True:
            try:
                answer = self._answers.get(timeout=_WAKE_S)
            except queue.Empty:
                continue
            if answer.get("id") == request_id:
                break
        if answer.get("interrupt"):
            raise KeyboardInterrupt(f"the cell was interrupted while rank {me} waited for input")
        if answer.get("error"):
            raise NoStdinError(answer["error"])
        if answer.get("eof"):
            raise EOFError
        return str(answer.get("value", ""))

    def answer(self, stream, idents, parent) -> None:
        """The control handler: hand the kernel's answer to the waiting main thread, acknowledge it."""
        content = parent.get("content", {})
        self._answers.put(dict(content))
        self.kernel.session.send(
            stream, _ACK, content={"status": "ok"}, parent=parent, ident=idents
        )


_bridge: StdinBridge | None = None


def install(kernel) -> StdinBridge:
    """Route this engine's ``input``, ``getpass`` and pdb to the notebook (idempotent).

    ``kernel``: the engine's ipykernel kernel, handed in by
    :func:`nbdist.engine.bootstrap.init_rank`. ipykernel installs
    ``kernel.raw_input``/``kernel.getpass`` as ``builtins.input``/``getpass.getpass``
    at the start of each execute request, so setting them here is enough.
    """
    global _bridge
    if _bridge is None or _bridge.kernel is not kernel:
        _bridge = StdinBridge(kernel)
    kernel.raw_input = _bridge.input
    kernel.getpass = _bridge.getpass
    kernel.control_handlers[INPUT_REPLY] = _bridge.answer
    pdb.Pdb = RankPdb
    return _bridge


def post_mortem() -> None:
    """pdb on the frame where this rank's last failed cell raised (what ``%dist_debug`` runs).

    IPython keeps that exception in ``sys.last_value``/``sys.last_traceback``
    when it shows the error; ``q`` leaves the debugger and the rank is ready.
    """
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        print(f"rank {rank()}: no failed cell to debug (no exception kept on this rank)")
        return
    value = getattr(sys, "last_value", None)
    print(f"post-mortem of rank {rank()}: {type(value).__name__}: {value}")
    debugger = RankPdb()
    debugger.reset()
    debugger.interaction(None, tb)
