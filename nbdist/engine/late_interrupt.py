"""Rank side: an interrupt that missed the request it was meant for on this rank.

Between requests an engine ignores SIGINT (ipyparallel's engine logs it);
during one, this module's hooks install :mod:`nbdist.engine.request_sigint`'s
handler (a KeyboardInterrupt in the user's code), where ipykernel installs
Python's own.
The kernel sends a request, then a Ctrl-C relays SIGINT to the ranks. A rank that
had not begun the request yet (the kernel interrupted while it was in flight, at
many ranks the last begin seconds after the first, or the rank was finishing an
earlier request the SIGINT then ended) would run the whole request after it. So
the kernel asks each rank still running it (:func:`interrupt_request`, on the
control channel, answered whatever the rank does):

- not begun: the rank drops it unrun (ipyparallel's own mechanism: its engine
  replies "aborted" to a request whose id it was told to abort);
- begun after this interrupt's SIGINT came (on the kernel's machine, whose clock
  it shares: a SIGINT this rank noted after the kernel began sending them, while
  it was idle or finishing an earlier request), or, on another machine, after a
  SIGINT that came while the rank was idle: interrupted now;
- otherwise, or ended: nothing (the SIGINT landed, or nothing is left).

Between ipyparallel's check for a dropped request and the start of its handling a
request is neither: the rank answers "dropped" (or "beginning") and the kernel
asks again.

The rank also notes the request in whose user code a SIGINT raised
KeyboardInterrupt: while the user's code still runs in that request, it caught it (an
``except`` or ``finally`` block) or is unwinding, and the kernel does not SIGINT it
again (:func:`interrupt_answer`, asked by :mod:`nbdist.driver.caught_interrupts`).
Nor does it SIGINT a rank whose request runs outside the user's code (reporting an
error, sending the reply) or that runs no request any more (its reply is on its way).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque

from nbdist.engine.request_sigint import Redelivery, RequestSigint, runs_user_code

__all__ = ["boot_id", "handling_interrupt", "install", "interrupt_answer", "interrupt_request"]

# Ended requests remembered, so a late question about one is not taken for one to come.
_ENDED_KEPT = 256


class _Requests:
    """What this rank's main thread handles, as the control thread reads it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: str | None = None
        self.interrupted: str | None = None  # the request this rank last interrupted itself
        self.ended: deque[str] = deque(maxlen=_ENDED_KEPT)
        self.ended_at = 0.0  # monotonic: when the request before the current one ended
        # When a SIGINT last came while idle, and (request, when) one last came during a
        # request (set in a signal handler: no lock taken, the main thread may hold it there).
        self.idle_sigint_at: float | None = None
        self.request_sigint: tuple[str | None, float] | None = None
        # The request a SIGINT came for outside the user's code, held until that code runs
        # (request_sigint.py; set in the signal handler, like idle_sigint_at).
        self.held: str | None = None
        # The request in whose user code a SIGINT last raised KeyboardInterrupt (set in the
        # signal handler too).
        self.raised_in: str | None = None
        # The shell's user namespace, whose frames are the user's code (request_sigint.py).
        self.user_globals: dict | None = None


_requests = _Requests()


class _IdleSigint:
    """SIGINT's handler between requests: notes when it came, then does what the one it
    replaced did (ipyparallel's engine logs that it ignores it)."""

    def __init__(self, replaced) -> None:
        self.replaced = replaced

    def __call__(self, signum, frame) -> None:
        _requests.idle_sigint_at = time.monotonic()
        if callable(self.replaced):
            self.replaced(signum, frame)


def _follow_idle_sigint() -> None:
    """Between requests SIGINT is ignored (``SIG_IGN``, or ipyparallel's handler that logs
    it): note its coming too. Set on the main thread only, where handlers are set."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, _IdleSigint) or handler in (signal.default_int_handler, signal.SIG_DFL):
        return  # followed already, or SIGINT is not ignored here: it raises or ends the process
    if handler is None:  # set from outside Python: left alone
        return
    signal.signal(signal.SIGINT, _IdleSigint(handler))


def _held() -> None:
    # In the signal handler, on the main thread: no lock (the hooks may hold it there).
    _requests.request_sigint = (_requests.current, time.monotonic())
    _requests.held = _requests.current


def _raised() -> None:
    _requests.request_sigint = (_requests.current, time.monotonic())
    _requests.held = None
    _requests.raised_in = _requests.current


def _still_held() -> bool:
    """Whether a held SIGINT should be tried again: its request still runs."""
    with _requests.lock:
        if _requests.held is not None and _requests.held != _requests.current:
            _requests.held = None  # that request ended: post_handler_hook noted it
        return _requests.held is not None


def install(kernel) -> None:
    """Follow which request ``kernel`` handles, raise SIGINT's KeyboardInterrupt during one
    only in the user's code, and note SIGINTs between requests (idempotent)."""
    pre, post = kernel.pre_handler_hook, kernel.post_handler_hook
    if getattr(pre, "nbdist_original", None) is not None:
        return
    redelivery = Redelivery(_still_held)

    def pre_handler_hook():
        parent = kernel.get_parent("shell") or {}
        with _requests.lock:
            _requests.current = parent.get("header", {}).get("msg_id")
            _requests.held = None
        # What ipykernel's own hook does (keep the handler from before the request, to
        # put back after it), but the handler raises KeyboardInterrupt in the user's code
        # only (request_sigint.py); set in one call, so no SIGINT meets Python's own
        # handler here, where a KeyboardInterrupt would end the engine's event loop.
        shell = getattr(kernel, "shell", None)
        user_globals = getattr(shell, "user_global_ns", None)
        _requests.user_globals = user_globals
        handler = RequestSigint(user_globals, _held, _raised, redelivery)
        kernel.saved_sigint_handler = signal.signal(signal.SIGINT, handler)

    def post_handler_hook():
        post()  # the handler from before the request again
        with _requests.lock:
            if _requests.current is not None:
                _requests.ended.append(_requests.current)
            _requests.ended_at = time.monotonic()
            if _requests.held is not None and _requests.held == _requests.current:
                # It came too late for this request (in its last moments, after the
                # reply, which at many ranks is when the kernel sends the next): for the
                # next, as one that came while idle, once this one had ended.
                _requests.idle_sigint_at = _requests.ended_at
            _requests.held = None
            _requests.current = None
        _follow_idle_sigint()

    pre_handler_hook.nbdist_original = pre
    post_handler_hook.nbdist_original = post
    kernel.pre_handler_hook = pre_handler_hook
    kernel.post_handler_hook = post_handler_hook


def handling_interrupt() -> bool:
    """Whether the request this rank runs goes on after a SIGINT raised KeyboardInterrupt in
    its user code: that code caught it (an ``except KeyboardInterrupt`` or ``finally`` block
    saving a checkpoint, a library's shutdown), or it is still unwinding. Another SIGINT
    would cut it short, as a second Ctrl-C does in a kernel of its own, and could not reach
    a request queued behind it (that one is dropped: :func:`interrupt_request`)."""
    with _requests.lock:
        return _requests.current is not None and _requests.raised_in == _requests.current


def interrupt_answer() -> str:
    """What the request this rank runs does after the kernel's SIGINT, as the kernel asks it
    from the control thread (half a second after sending it, and again at the end of its
    wait for the interrupted ranks).

    "caught": it raised KeyboardInterrupt in the user's code, which still runs
    (:func:`handling_interrupt`): waited for and named. "outside": no frame of the user's
    namespace is on the main thread's stack: the engine is reporting an error (the
    KeyboardInterrupt's, or a released collective's: IPython formats the traceback,
    seconds a rank at 64 ranks on 2 cores) or sending the reply, and ends the request by
    itself, or has not reached the user's code yet, where a SIGINT held meanwhile lands;
    another SIGINT would only be held. "idle": no request runs (the one asked about
    ended and its reply is on its way, or it has not begun: :func:`interrupt_request`
    drops it). "": the user's code runs and the SIGINT did not reach it.
    """
    with _requests.lock:
        if _requests.current is None:
            return "idle"
    frame = sys._current_frames().get(threading.main_thread().ident)  # noqa: SLF001 - the only way
    if not runs_user_code(frame, _requests.user_globals):
        return "outside"
    return "caught" if handling_interrupt() else ""


def boot_id() -> str:
    """This machine's boot id: processes that share it read one ``time.monotonic`` clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _missed(since: float | None) -> bool:
    """Whether the current request missed the kernel's SIGINT (``_requests.lock`` held).

    ``since``: when the kernel began sending its SIGINTs, on this machine's clock: then
    a SIGINT that came after it, before the request began, missed it (it came while
    the rank was idle, or ended the request before). The kernel's own time after sending
    them is no bound: a loaded kernel takes its next step after the rank has ended the
    request before and begun this one (CI, 2026-12-02). ``since`` None (the kernel's
    clock is another machine's): a SIGINT that came while idle since the request before
    this one ended.
    """
    if since is not None:
        # Before the request began: one that came while idle (also in the moment between
        # the request's beginning and its handler, which the idle handler took), or during
        # an earlier request. One during this request met it.
        before = [_requests.idle_sigint_at]
        if _requests.request_sigint is not None:
            request, at = _requests.request_sigint
            if request != _requests.current:
                before.append(at)
        return any(at is not None and at >= since for at in before)
    came = _requests.idle_sigint_at
    return came is not None and came >= _requests.ended_at


def interrupt_request(kernel, msg_id: str, since: float | None = None, boot: str = "") -> str:
    """Stop request ``msg_id`` on this rank if the kernel's SIGINT missed it; what was done.

    A request missed it if the SIGINT came before it began: after ``since``, when the
    kernel began sending its SIGINTs (its ``time.monotonic``; compared only on the
    kernel's machine, ``boot`` being its :func:`boot_id`), or, from another machine,
    while this rank was idle just before the request.

    "dropped" (not begun: it will not run), "beginning" (about to run: ask again),
    "interrupted" (it missed the SIGINT: SIGINT again), "running" (it began before
    the SIGINT: that landed), "ended".
    """
    same_clock = since is not None and boot != "" and boot == boot_id()
    with _requests.lock:
        if msg_id == _requests.current:
            idle = isinstance(signal.getsignal(signal.SIGINT), _IdleSigint)
            if idle:
                return "beginning"  # a SIGINT now would only be noted
            if not _missed(since if same_clock else None) or _requests.interrupted == msg_id:
                return "running"
            _requests.interrupted = msg_id  # once: asked again, it is "running"
            os.kill(os.getpid(), signal.SIGINT)
            return "interrupted"
        if msg_id in _requests.ended:
            return "ended"
        aborted = getattr(kernel, "aborted", None)  # ipyparallel's engine kernel has it
        if aborted is None:
            return "running"
        aborted.add(msg_id)
        return "dropped"
