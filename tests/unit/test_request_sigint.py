"""A rank's SIGINT during a request: raised only in the user's code, held elsewhere, and one
held to a request's end counts as missed by the next (nbdist.engine.request_sigint and the
bookkeeping of nbdist.engine.late_interrupt, on a stand-in for the engine's kernel: the real
engines' behaviour is tested in tests/dist/test_interrupts.py)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from nbdist.engine import late_interrupt
from nbdist.engine.request_sigint import RequestSigint, runs_user_code


def test_user_code_is_a_frame_in_the_user_namespace_or_below_one():
    user_ns: dict = {"__name__": "__main__"}
    exec("def cell():\n    return inner()\n", user_ns)
    user_ns["inner"] = sys._getframe  # a C function: it returns the frame of the cell calling it
    frame = user_ns["cell"]()
    assert frame.f_globals is user_ns
    assert runs_user_code(frame, user_ns)
    assert not runs_user_code(sys._getframe(), user_ns)  # the engine's code: this test
    # A library the cell called: its frame's globals are its module's, the cell's is below.
    exec("def call(f):\n    return f()\n", lib := {"__name__": "lib"})
    user_ns["call"] = lib["call"]
    exec("def cell2():\n    return call(frame_of_call)\n", user_ns)
    user_ns["frame_of_call"] = lambda: sys._getframe(1)  # the frame of its caller: the library's
    library_frame = user_ns["cell2"]()
    assert library_frame.f_globals is lib
    assert runs_user_code(library_frame, user_ns)
    assert runs_user_code(sys._getframe(), None)  # no shell to tell: raise, as Python would


class _Kernel:
    """What late_interrupt.install uses of ipykernel's kernel, with ipykernel's own hooks."""

    def __init__(self) -> None:
        self.parent: dict = {}
        self.aborted: set[str] = set()
        self.shell = type("Shell", (), {"user_global_ns": {}})()

    def get_parent(self, channel):
        return self.parent

    def pre_handler_hook(self):
        self.saved_sigint_handler = signal.signal(signal.SIGINT, signal.default_int_handler)

    def post_handler_hook(self):
        signal.signal(signal.SIGINT, self.saved_sigint_handler)


@pytest.fixture
def kernel():
    before = signal.getsignal(signal.SIGINT)
    yield _Kernel()
    signal.signal(signal.SIGINT, before)


def _handle(kernel, msg_id: str, during=lambda: None) -> None:
    kernel.parent = {"header": {"msg_id": msg_id}}
    kernel.pre_handler_hook()
    during()
    kernel.post_handler_hook()


def test_a_sigint_held_to_the_end_of_a_request_counts_as_missed_by_the_next(kernel):
    """At many ranks the kernel sends the next cell while a rank is still in the last
    moments of the one before (after its reply): a SIGINT there is held, that request
    ends, and the next cell must count as having missed it, or the rank runs it whole."""
    late_interrupt.install(kernel)
    _handle(kernel, "before")  # a request with no SIGINT at all
    kernel.parent = {"header": {"msg_id": "cell"}}
    kernel.pre_handler_hook()
    assert isinstance(signal.getsignal(signal.SIGINT), RequestSigint)
    with late_interrupt._requests.lock:
        assert not late_interrupt._missed(None)  # nothing came: the cell runs on
    kernel.post_handler_hook()
    since = time.monotonic()  # the kernel begins sending its SIGINTs
    # The SIGINT comes in the engine's code at the end of "ended" (held: what the handler does).
    _handle(kernel, "ended", during=late_interrupt._held)
    kernel.parent = {"header": {"msg_id": "next"}}
    kernel.pre_handler_hook()
    try:
        with late_interrupt._requests.lock:
            assert late_interrupt._missed(since)  # on the kernel's machine
            assert late_interrupt._missed(None)  # from another machine's kernel
            # A SIGINT of an earlier interrupt is not this one's.
            assert not late_interrupt._missed(time.monotonic())
    finally:
        kernel.post_handler_hook()
    assert late_interrupt._requests.held is None


def test_a_request_that_began_after_the_sigint_ended_the_one_before_missed_it(kernel):
    """The SIGINT raises in the cell a rank was finishing; that cell catches it and ends, and
    the request the kernel waits for begins at once, maybe before the kernel has sent the
    rest of its SIGINTs: it missed the SIGINT. One that began before the SIGINT came did not."""
    late_interrupt.install(kernel)
    _handle(kernel, "before")
    since = time.monotonic()
    _handle(kernel, "finishing", during=late_interrupt._raised)  # its code caught it
    kernel.parent = {"header": {"msg_id": "waited-for"}}
    kernel.pre_handler_hook()
    try:
        with late_interrupt._requests.lock:
            assert late_interrupt._missed(since)
            # Another machine's kernel: only a SIGINT that came while idle counts.
            assert not late_interrupt._missed(None)
    finally:
        kernel.post_handler_hook()
    kernel.parent = {"header": {"msg_id": "running"}}
    kernel.pre_handler_hook()
    since = time.monotonic()
    late_interrupt._raised()  # the SIGINT lands in this request
    try:
        with late_interrupt._requests.lock:
            assert not late_interrupt._missed(since)
    finally:
        kernel.post_handler_hook()


def test_a_sigint_the_idle_handler_took_as_the_request_began_was_missed(kernel):
    """Between the moment a request becomes current and its own handler, SIGINT still meets
    the idle one, which only notes it: the request missed it."""
    late_interrupt.install(kernel)
    _handle(kernel, "before")
    since = time.monotonic()
    kernel.parent = {"header": {"msg_id": "beginning"}}
    kernel.pre_handler_hook()
    try:
        late_interrupt._IdleSigint(None)(signal.SIGINT, None)  # what the idle handler did
        with late_interrupt._requests.lock:
            assert late_interrupt._missed(since)
    finally:
        kernel.post_handler_hook()
