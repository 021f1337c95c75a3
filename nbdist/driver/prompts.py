"""Kernel side: answer the ranks' ``input()``, ``getpass`` and pdb prompts from the notebook's stdin.

A rank that asks for input publishes an ``nbdist_input_request`` on its IOPub
channel (see :mod:`nbdist.engine.stdin_bridge`); ipyparallel's IO thread hands
it to the cell's :class:`~nbdist.driver.runner.RankRun`, whose waiting loop
calls :meth:`PromptServer.serve`. The prompt is asked here with the kernel's
own ``input``/``getpass`` (in a Jupyter kernel: the front end's input box,
through Jupyter's stdin channel; in a script: the terminal), and the answer
goes back on the rank's control channel. Prompts are served one at a time,
each labelled with its rank, in the order they arrived, except that a rank
just answered keeps the prompt for :data:`STICKY_S`: a pdb session on one
rank (``p x``, ``n``, ``n``) is not interleaved with another rank's prompts
until it continues (``c``) or stays quiet.

When the front end has no stdin (nbclient or nbconvert without
``allow_stdin``, papermill), ipykernel raises ``StdinNotImplementedError`` at
once: the rank then raises :class:`~nbdist.engine.stdin_bridge.NoStdinError`
with :data:`NO_STDIN` and the cell fails, naming the rank, instead of hanging.
"""

from __future__ import annotations

import builtins
import getpass
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from nbdist.driver.ipp_internals import send_control
from nbdist.engine.stdin_bridge import INPUT_REPLY, INPUT_REQUEST

__all__ = ["NO_STDIN", "STICKY_S", "PromptServer", "ask_front_end", "stdin_attached"]

# How long the rank just answered keeps the turn: its next prompt (and the
# output before it) comes back in milliseconds unless it went on running.
STICKY_S = 0.5

NO_STDIN = (
    "rank {rank} asked for input ({prompt!r}: breakpoint(), pdb, input() or getpass), "
    "but this front end sends no input: a notebook run headless (nbclient, nbconvert, "
    "papermill) has no stdin. Run the cell in a front end with stdin (JupyterLab, "
    "Notebook, VS Code), or run such cells only when one is attached (docs/debugging.md)"
)


def ask_front_end(prompt: str, password: bool) -> str:
    """Ask the kernel's own user: the notebook's input box in a Jupyter kernel, else the terminal."""
    # Looked up at call time: ipykernel puts its stdin-forwarding versions in
    # these places for the duration of each execute request.
    if password:
        return getpass.getpass(prompt)
    return builtins.input(prompt)


def stdin_attached() -> bool:
    """True when the running cell's front end answers input requests (a human can type).

    In a Jupyter kernel: the ``allow_stdin`` of the cell's execute request
    (False under nbclient, nbconvert and papermill); elsewhere: stdin is a
    terminal. Cells that wait for a human run only when this is True, so a
    notebook also runs headless::

        from nbdist.driver.prompts import stdin_attached
        if stdin_attached():
            %dist_debug
    """
    shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return bool(sys.stdin is not None and sys.stdin.isatty())
    parent = kernel.get_parent("shell") or {}
    return bool(parent.get("content", {}).get("allow_stdin", False))


def _no_stdin(exc: BaseException) -> bool:
    # IPython's StdinNotImplementedError, by name: the driver does not import IPython for it.
    return any(cls.__name__ == "StdinNotImplementedError" for cls in type(exc).__mro__)


class PromptServer:
    """The input requests of one cell's ranks, answered one at a time."""

    def __init__(
        self,
        client,
        engine_ids: Sequence[int],
        ranks: Sequence[int],
        *,
        ask: Callable[[str, bool], str] = ask_front_end,
    ):
        """Serve the prompts of ``ranks`` (running on ``engine_ids``, same order) through ``client``.

        ``ask(prompt, password)`` asks the user (default: :func:`ask_front_end`).
        """
        self._client = client
        self._engine_of = dict(zip(ranks, engine_ids))
        self._ask = ask
        self._pending: deque[tuple[int, dict]] = deque()  # (rank, request), oldest first
        self._lock = threading.Lock()
        self._cancelled = False
        # Set once the front end said it has no stdin: later prompts fail at once.
        self.no_stdin = ""
        self.waited = 0.0  # seconds spent waiting for the user, in total
        self._last_rank: int | None = None
        self._last_answer = 0.0

    def offer(self, rank: int, msg: dict) -> bool:
        """An IOPub message from ``rank``: True if it was an input request (kept for :meth:`serve`)."""
        if msg["header"]["msg_type"] != INPUT_REQUEST:
            return False
        with self._lock:
            self._pending.append((rank, dict(msg["content"])))
        return True

    def pending(self) -> bool:
        """A prompt is due: the rank just answered asked again, or it kept quiet for :data:`STICKY_S`."""
        with self._lock:
            if not self._pending:
                return False
            if self._cancelled or any(rank == self._last_rank for rank, _ in self._pending):
                return True
        return time.monotonic() - self._last_answer >= STICKY_S

    def cancel(self) -> None:
        """The cell was interrupted or timed out: no prompt is asked any more.

        Ranks waiting for an answer get the SIGINT that follows (an answer sent
        now would race with it); prompts that arrive later are answered with an
        interrupt.
        """
        self._cancelled = True

    def serve(self, deadline: float | None, *before_asking: Callable[[], None]) -> float | None:
        """Answer the oldest prompt; returns ``deadline`` moved by the time the user took.

        ``before_asking`` are called first: they show the output received so
        far, unfinished lines too (pdb's listing comes before its prompt). A
        KeyboardInterrupt while the user is asked (the kernel's interrupt)
        propagates: the caller interrupts the ranks.
        """
        spent = self._serve(before_asking)
        return None if deadline is None else deadline + spent

    def _serve(self, before_asking) -> float:
        if self._cancelled:
            self._answer_all({"interrupt": True})
            return 0.0
        with self._lock:
            if not self._pending:
                return 0.0
            mine = [i for i, (r, _) in enumerate(self._pending) if r == self._last_rank]
            if mine:
                rank, request = self._pending[mine[0]]
                del self._pending[mine[0]]
            else:
                rank, request = self._pending.popleft()
        prompt = str(request.get("prompt", ""))
        if self.no_stdin:
            self._send(rank, request, {"error": self.no_stdin.format(rank=rank, prompt=prompt)})
            return 0.0
        for show in before_asking:
            show()
        started = time.monotonic()
        try:
            value = self._ask(prompt, bool(request.get("password")))
        except EOFError:
            reply = {"eof": True}
        except Exception as exc:
            if not _no_stdin(exc):
                raise
            self.no_stdin = NO_STDIN
            reply = {"error": NO_STDIN.format(rank=rank, prompt=prompt)}
        else:
            reply = {"value": value}
        finally:
            spent = time.monotonic() - started
            self.waited += spent
        self._send(rank, request, reply)
        self._last_rank, self._last_answer = rank, time.monotonic()
        return spent

    def _answer_all(self, reply: dict) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                rank, request = self._pending.popleft()
            self._send(rank, request, reply)

    def _send(self, rank: int, request: dict, reply: dict) -> None:
        content = {"id": request.get("id"), **reply}
        try:
            send_control(self._client, self._engine_of[rank], INPUT_REPLY, content)
        except Exception:  # the engine is gone (it died): nothing waits for the answer
            pass
