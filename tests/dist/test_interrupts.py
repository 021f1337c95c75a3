"""Interrupting the ranks from the kernel: Ctrl-C, whenever it comes, stops what the kernel
waits for on every rank (real engines, a real gloo group of 2 CPU ranks)."""

from __future__ import annotations

import threading
import time

import pytest

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


def test_interrupt_reaches_every_rank_and_next_run_works(session):
    run = session.run(
        "import time\nprint('sleeping', flush=True)\ntime.sleep(60)", block=False, sink=ListSink()
    )
    time.sleep(1.0)
    t0 = time.monotonic()
    session.interrupt()
    with pytest.raises(RankError) as info:
        run.wait()
    assert time.monotonic() - t0 < 30
    assert info.value.ranks == [0, 1]
    assert all(f.ename == "KeyboardInterrupt" for f in info.value.failures)
    session.run("after = rank + 100")
    assert session.pull("after") == [100, 101]


@pytest.mark.parametrize(
    "code",
    ["import time\ntime.sleep(60)", "import time\nfor _ in range(600):\n    time.sleep(0.1)"],
    ids=["ends with an expression", "shows nothing (sent silent)"],
)
def test_keyboard_interrupt_in_the_waiting_thread_is_relayed(session, code):
    """Ctrl-C in the kernel arrives as KeyboardInterrupt in the waiting loop."""
    import _thread

    session.run("warm = 1")  # the ranks' replies say how their shells show values
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        session.run(code, sink=ListSink())
    timer.cancel()
    assert time.monotonic() - t0 < 30
    session.run("ok = 1")
    assert session.pull("ok") == [1, 1]


class _SwallowingSink(ListSink):
    """A sink that catches KeyboardInterrupt, as some code the kernel runs while a cell waits
    does (a library's output hook; a finalizer, where Python drops every exception)."""

    def __init__(self, inside: threading.Event, sent: threading.Event):
        super().__init__()
        self.inside, self.sent, self.swallowed = inside, sent, 0

    def line(self, stream, label, text):
        super().line(stream, label, text)
        if self.swallowed:
            return
        self.inside.set()
        try:
            while not self.sent.is_set():  # Python code: the signal's handler runs in here
                pass
            for _ in range(1_000_000):
                pass
        except KeyboardInterrupt:
            self.swallowed += 1


def test_a_ctrl_c_swallowed_while_the_cell_waits_still_stops_it(session):
    """Ctrl-C raised inside code that drops it (here a sink's write) still stops the cell."""
    import _thread

    inside, sent = threading.Event(), threading.Event()

    def interrupt_once_inside() -> None:
        if inside.wait(60):
            _thread.interrupt_main()  # SIGINT's handler, as the kernel's interrupt runs it
            sent.set()

    timer = threading.Thread(target=interrupt_once_inside, daemon=True)
    timer.start()
    sink = _SwallowingSink(inside, sent)
    code = "import time\nprint('started', flush=True)\nfor _ in range(600):\n    time.sleep(0.1)"
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        session.run(code, sink=sink)
    timer.join(5)
    assert sink.swallowed == 1, "the Ctrl-C did not land in the sink: the test proves nothing"
    assert time.monotonic() - t0 < 30  # not the 60 s the cell takes
    session.run("ok = 3")
    assert session.pull("ok") == [3, 3]


_SLOW = "import time\nfor _ in range(600):\n    time.sleep(0.1)"


def _interrupted_on_entering(code, call, session) -> BaseException:
    """The KeyboardInterrupt ``call(session)`` raised, the kernel's interrupt played as the
    main thread entered ``code`` (handled at the function's first instruction)."""
    import _thread
    import sys

    fired = []

    def on_call(frame, event, arg):
        if event == "call" and frame.f_code is code and not fired:
            fired.append(True)
            _thread.interrupt_main()

    sys.setprofile(on_call)
    try:
        with pytest.raises(KeyboardInterrupt) as caught:
            call(session)
    finally:
        sys.setprofile(None)
    assert fired, f"{code.co_qualname} was not reached: the test proves nothing"
    return caught.value


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.run(_SLOW, sink=ListSink()),
        lambda s: s.run(_SLOW, block=False, sink=ListSink()),
        lambda s: s.apply(time.sleep, 60),
    ],
    ids=["cell", "noblock cell", "apply"],
)
def test_a_ctrl_c_while_the_cell_is_sent_interrupts_it_on_the_ranks(session, call):
    """Ctrl-C landing after the request left for the ranks but before the kernel waits for it
    (a loaded kernel is slow there while the ranks already run) stops it on the ranks, as
    one during the wait does, instead of ending only the kernel's side. The SIGINT often
    comes before a rank began the request (an idle engine ignores it): the rank then drops
    the request, or stops it as it begins, instead of running it whole (for ``apply``, with
    no cell guard to interrupt again, it ran whole)."""
    from nbdist.driver.runner import RankRun
    from nbdist.errors import RanksInterrupted

    t0 = time.monotonic()
    # The kernel's interrupt once the request is sent: every path builds the RankRun that
    # follows it only then.
    caught = _interrupted_on_entering(RankRun.__init__.__code__, call, session)
    # Not a bare KeyboardInterrupt from the kernel's side: the ranks were interrupted.
    assert isinstance(caught, RanksInterrupted), repr(caught)
    assert "every rank stopped" in str(caught), str(caught)
    assert time.monotonic() - t0 < 10  # not the 60 s the request takes, nor the 10 s grace
    session.run("after = 2")  # runs now: the ranks are not still in the request
    assert session.pull("after") == [2, 2]


@pytest.mark.parametrize(
    "call",
    [lambda s: s.run(_SLOW, sink=ListSink()), lambda s: s.apply(time.sleep, 60)],
    ids=["cell", "apply"],
)
def test_a_ctrl_c_as_the_wait_begins_interrupts_it_on_the_ranks(session, call):
    """Ctrl-C landing on the very call that begins the kernel's wait (the moment it stops
    only noting a Ctrl-C and lets one raise) is the ranks' interrupt too, not a bare
    KeyboardInterrupt of the kernel's that leaves the ranks running (a loaded CI machine
    met it: the lab debugger's interrupt of paused ranks)."""
    from nbdist.driver.runner import RankRun
    from nbdist.errors import RanksInterrupted

    caught = _interrupted_on_entering(RankRun._wait.__code__, call, session)
    assert isinstance(caught, RanksInterrupted), repr(caught)
    assert "every rank stopped" in str(caught), str(caught)
    session.run("after = 3")  # runs now: the ranks are not still in the request
    assert session.pull("after") == [3, 3]


def _miss_one_interrupt(seconds: float) -> str:
    """Applied on a rank: the first SIGINT does not reach this code (as one that came while
    the engine did not run it), the next ones do; sleeps ``seconds`` after the first."""
    import signal
    import threading
    import time

    reached = threading.Event()
    handler = signal.signal(signal.SIGINT, lambda *_: reached.set())
    try:
        reached.wait(seconds)
    finally:
        signal.signal(signal.SIGINT, handler)
    time.sleep(seconds)
    return "ran whole"


_miss_one_interrupt.__module__ = "__main__"


def test_an_interrupted_apply_interrupts_again_the_ranks_that_did_not_stop(session):
    """An ``apply`` has no cell guard, which SIGINTs a cell's ranks again: a rank the first
    SIGINT did not reach ran the whole call (CI: an interrupted ``apply`` left a rank
    running for the 10 s grace), now it is interrupted once more, a second later."""
    import _thread

    from nbdist.errors import RanksInterrupted

    session.run("warm = 1")
    timer = threading.Timer(1.5, _thread.interrupt_main)
    timer.start()
    with pytest.raises(RanksInterrupted) as caught:
        session.apply(_miss_one_interrupt, 60)
    timer.cancel()
    assert "every rank stopped" in str(caught.value), str(caught.value)
    session.run("after = 4")  # runs now: no rank is still in the call
    assert session.pull("after") == [4, 4]


def _interrupt_when(ready, *, limit: float = 120.0) -> threading.Thread:
    """A thread that interrupts the kernel's main thread (as the kernel's interrupt does)
    once ``ready()`` is true."""
    import _thread

    def watch():
        deadline = time.monotonic() + limit
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        _thread.interrupt_main()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _began_on_every_rank(folder, world_size: int):
    import os

    return lambda: len(os.listdir(folder)) >= world_size


# Marks that the rank is inside the try (the Ctrl-C is meant for that moment), computes until
# interrupted, then handles the KeyboardInterrupt with {handling}.
_CATCHING_CELL = (
    "import os, time\n"
    "try:\n"
    "    open(os.path.join({began!r}, str(rank)), 'w').close()\n"
    "    while True:\n"
    "        time.sleep(0.01)\n"
    "except KeyboardInterrupt:\n"
    "{handling}"
)
# A checkpoint written on Ctrl-C: 2 s, then a file, then the KeyboardInterrupt goes on.
_SAVE_ON_CTRL_C = (
    "    time.sleep(2.0)\n"
    "    open(os.path.join({saved!r}, str(rank)), 'w').write('saved')\n"
    "    print('saved', rank, flush=True)\n"
    "    raise\n"
)


def _save_on_ctrl_c(began: str, saved: str) -> str:
    """Applied on a rank: as _CATCHING_CELL with _SAVE_ON_CTRL_C, returning instead of raising."""
    import os
    import time

    from IPython import get_ipython

    rank = get_ipython().user_ns["rank"]
    try:
        open(os.path.join(began, str(rank)), "w").close()
        while True:
            time.sleep(0.01)
    except KeyboardInterrupt:
        time.sleep(2.0)
        open(os.path.join(saved, str(rank)), "w").write("saved")
    return "saved"


_save_on_ctrl_c.__module__ = "__main__"


@pytest.mark.parametrize("call", ["cell", "apply"])
def test_code_that_catches_the_interrupt_runs_to_its_end(session, tmp_path, call):
    """A rank whose code catches the KeyboardInterrupt (a checkpoint written on Ctrl-C, a
    library's shutdown) runs that code to its end, and the cell waits for it, as a kernel
    of its own does. Before, the guard SIGINTed every rank still running 0.5 s (a cell) or
    1 s (an ``apply``) after the interrupt: the handling code was cut short and the
    checkpoint never written."""
    import os

    from nbdist.errors import RanksInterrupted

    began, saved = tmp_path / "began", tmp_path / "saved"
    began.mkdir()
    saved.mkdir()
    sink = ListSink()
    _interrupt_when(_began_on_every_rank(began, session.world_size))
    with pytest.raises(RanksInterrupted) as caught:
        if call == "cell":
            handling = _SAVE_ON_CTRL_C.format(saved=str(saved))
            session.run(_CATCHING_CELL.format(began=str(began), handling=handling), sink=sink)
        else:
            session.apply(_save_on_ctrl_c, str(began), str(saved))
    assert sorted(os.listdir(saved)) == ["0", "1"], "the handling code was cut short"
    said = str(caught.value)
    assert said.startswith("interrupted; every rank stopped"), said
    assert "ranks 0-1 first ran their own code that caught the KeyboardInterrupt" in said, said
    if call == "cell":
        lines = [e[3] for e in sink.events if e[0] == "line"]
        assert "saved 0" in lines and "saved 1" in lines, lines
        notes = [e[2] for e in sink.events if e[0] == "line" and "runs on" in e[3]]
        assert notes == ["ranks 0-1"], sink.events
    session.run("after = rank + 7")
    assert session.pull("after") == [7, 8]


def test_code_that_caught_the_interrupt_quickly_is_named_as_such(session, tmp_path):
    """Handling code done before the kernel asks the ranks still running (0.5 s after the
    interrupt) is named like slower code: the cell's reply says so. Before, such a cell
    read as one the interrupt came too late for ("every rank had run the cell to its
    end")."""
    from nbdist.errors import RanksInterrupted

    began = tmp_path / "began"
    began.mkdir()
    handling = "    print('handled', rank, flush=True)\n"
    sink = ListSink()
    _interrupt_when(_began_on_every_rank(began, session.world_size))
    with pytest.raises(RanksInterrupted) as caught:
        session.run(_CATCHING_CELL.format(began=str(began), handling=handling), sink=sink)
    lines = [e[3] for e in sink.events if e[0] == "line"]
    assert "handled 0" in lines and "handled 1" in lines, lines
    said = str(caught.value)
    assert said == (
        "interrupted; every rank stopped (ranks 0-1 first ran their own code that caught "
        "the KeyboardInterrupt)"
    ), said
    shown = caught.value._render_traceback_()
    assert shown[0] == "KeyboardInterrupt: the cell was interrupted on every rank", shown
    session.run("after = rank + 3")
    assert session.pull("after") == [3, 4]


def test_a_collective_in_code_that_caught_the_interrupt_is_released(session, tmp_path):
    """A rank whose handling code enters a collective that the other ranks, which did not
    catch the interrupt, never enter is released from it (it would wait for the group's
    timeout) and the group is formed again."""
    from nbdist.errors import RanksInterrupted

    began = tmp_path / "began"
    began.mkdir()
    handling = "    if rank == 0:\n        dist.barrier()\n    raise\n"
    _interrupt_when(_began_on_every_rank(began, session.world_size))
    with pytest.raises(RanksInterrupted) as caught:
        session.run(_CATCHING_CELL.format(began=str(began), handling=handling), sink=ListSink())
    shown = "\n".join(caught.value._render_traceback_())
    assert "released: rank 0 from barrier #" in shown, shown
    assert "The process group was formed again" in shown, shown
    session.run("t = torch.ones(1)\ndist.all_reduce(t)\ntotal = int(t)")
    assert session.pull("total") == [2, 2]


def test_a_second_ctrl_c_stops_code_that_caught_the_first(session, tmp_path):
    """Handling code that would not end by itself (it caught the KeyboardInterrupt and went
    on) stops at a second Ctrl-C, as in a kernel of its own."""
    from nbdist.errors import RanksInterrupted

    began = tmp_path / "began"
    began.mkdir()
    handling = "    while True:\n        time.sleep(0.01)\n"
    sink = ListSink()
    _interrupt_when(_began_on_every_rank(began, session.world_size))
    # The second once the cell said it waits for the ranks' handling code.
    noted = lambda: any(e[0] == "line" and "runs on" in e[3] for e in list(sink.events))  # noqa: E731
    _interrupt_when(noted)
    with pytest.raises(RanksInterrupted) as caught:
        session.run(_CATCHING_CELL.format(began=str(began), handling=handling), sink=sink)
    assert noted(), sink.events
    said = str(caught.value)
    assert said.startswith("interrupted; every rank stopped"), said
    session.run("after = 9")
    assert session.pull("after") == [9, 9]


def _mark_after(seconds: float) -> None:
    """Applied on a rank: sleeps, then leaves ``ran_late = True`` in its namespace."""
    import time

    from IPython import get_ipython

    time.sleep(seconds)
    get_ipython().user_ns["ran_late"] = True


# Sent by value (ipyparallel imports a function's module on the rank unless it is __main__'s;
# the ranks cannot import this test module).
_mark_after.__module__ = "__main__"


# A --noblock cell that takes a while to unwind from an interrupt (its except clause):
# a request queued behind it is still waiting when the kernel asks about it.
_SLOW_TO_STOP = (
    "import time\n"
    "unwound = False\n"
    "try:\n"
    "    time.sleep(60)\n"
    "except KeyboardInterrupt:\n"
    "    time.sleep(1.5)\n"
    "    unwound = True\n"
    "    raise"
)


def _interrupt_an_apply_behind(session, background_code: str, seconds: float, tmp_path):
    """Ctrl-C while ``apply`` waits behind a --noblock cell; (the KeyboardInterrupt, seconds
    it took, the cell's run)."""
    import _thread
    import os

    session.run("ran_late = False")
    # The Ctrl-C is meant for the cell once every rank runs inside its `try:`: a fixed second
    # after sending it could reach a loaded rank before that, which is not what these test.
    began = tmp_path / "began"
    began.mkdir()
    mark = f"    open(os.path.join({str(began)!r}, str(rank)), 'w').close()\n"
    code = "import os\n" + background_code.replace("try:\n", "try:\n" + mark, 1)
    background = session.run(code, block=False, sink=ListSink())
    deadline = time.monotonic() + 60
    while len(os.listdir(began)) < session.world_size and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(os.listdir(began)) == session.world_size, "the cell never began on every rank"
    timer = threading.Timer(1.0, _thread.interrupt_main)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as caught:
        session.apply(_mark_after, seconds)
    timer.cancel()
    return caught.value, time.monotonic() - t0, background


def test_a_ctrl_c_drops_a_request_queued_behind_a_running_cell(session, tmp_path):
    """The request the kernel waits for is queued behind a --noblock cell: the SIGINT stops
    the cell, and the request, which had not begun, is dropped instead of running after
    it (before: it ran whole, and the kernel said the ranks "did not stop"). The cell's
    own handling of the KeyboardInterrupt runs to its end: the request's guard does not
    SIGINT again a rank that runs such code (before, 1 s after the first, inside it)."""
    caught, took, background = _interrupt_an_apply_behind(session, _SLOW_TO_STOP, 0.0, tmp_path)
    assert "every rank stopped" in str(caught), str(caught)
    shown = "\n".join(caught._render_traceback_())
    assert "stopped before this rank began it: none of it ran here" in shown, shown
    assert took < 10, took  # not the interrupt's 10 s grace: nothing was left running
    with pytest.raises(RankError) as first:  # the SIGINT stopped the cell that was running
        background.wait()
    assert {f.ename for f in first.value.failures} == {"KeyboardInterrupt"}
    assert session.pull("unwound") == [True, True]
    time.sleep(0.5)
    assert session.pull("ran_late") == [False, False]


def test_a_ctrl_c_stops_a_request_that_began_after_it(session, tmp_path):
    """The SIGINT ends the cell the ranks were finishing, and the request the kernel waits
    for may begin right after it, before the kernel's question comes: it is interrupted
    then (or dropped, if the question came first), not run whole."""
    finishing = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass"
    caught, took, background = _interrupt_an_apply_behind(session, finishing, 20.0, tmp_path)
    assert "every rank stopped" in str(caught), str(caught)
    assert took < 10, took
    background.wait()  # the cell caught its interrupt and ended well: no RankError
    assert session.pull("ran_late") == [False, False]


def test_a_request_that_began_while_a_loaded_kernel_still_sent_its_sigints_is_stopped(
    session, tmp_path, monkeypatch
):
    """A loaded kernel can take a while between sending the SIGINTs and its next step: the
    cell the SIGINT ended ends at once, the request behind it begins before the kernel
    goes on, and it missed the SIGINT all the same (CI, 2026-12-02: "rank 0 did not stop";
    before, a rank counted only requests that began after the kernel had sent them all)."""
    sent = session.interrupt

    def loaded_kernel(ranks=None):
        sent(ranks)
        time.sleep(1.0)  # every rank has ended the cell and begun the request by now

    monkeypatch.setattr(session, "interrupt", loaded_kernel)
    finishing = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    pass"
    caught, took, background = _interrupt_an_apply_behind(session, finishing, 20.0, tmp_path)
    assert "every rank stopped" in str(caught), str(caught)
    assert took < 10, took
    background.wait()
    assert session.pull("ran_late") == [False, False]


def test_a_cell_a_rank_dropped_after_a_failed_one_says_so(session):
    """Without any interrupt, a rank drops the cells queued behind one that failed
    (ipykernel's stop-on-error): the dropped cell's error says that, not an opaque
    "TaskAborted" with a message id."""
    import os
    import tempfile

    go = os.path.join(tempfile.mkdtemp(), "go")
    waiting = session.run(
        f"import os, time\nwhile not os.path.exists({go!r}):\n    time.sleep(0.02)",
        block=False,
        sink=ListSink(),
    )
    failing = session.run("1 / 0", block=False, sink=ListSink())
    queued = session.run("never = 1", block=False, sink=ListSink())
    time.sleep(2.0)  # every cell has reached the ranks, behind the waiting one
    open(go, "w").close()
    waiting.wait()
    with pytest.raises(RankError, match="ZeroDivisionError"):
        failing.wait()
    with pytest.raises(RankError) as dropped:
        queued.wait()
    assert {f.ename for f in dropped.value.failures} == {"NotRun"}
    assert "dropped it unrun" in str(dropped.value), str(dropped.value)
    session.run("after = 4")
    assert session.pull("after") == [4, 4]


def test_sigints_while_short_requests_run_lose_no_reply_and_no_rank(session):
    """A SIGINT that lands on a rank while its engine (not the user's code) handles a
    request, unpacking it or sending the reply, neither loses the reply nor ends the
    rank: at many ranks one Ctrl-C finds ranks at those moments. Here SIGINTs come
    every 5-20 ms while the ranks run short cells and apply calls; each request must
    reply, either normally or with the KeyboardInterrupt its own code raised."""
    import os
    import random
    import signal

    pids = session.apply(os.getpid)
    stop, sent = threading.Event(), [0]

    def fire():
        while not stop.wait(random.uniform(0.005, 0.02)):
            for pid in pids:
                os.kill(pid, signal.SIGINT)
                sent[0] += 1

    firing = threading.Thread(target=fire, daemon=True)
    firing.start()
    interrupted = replied = 0
    try:
        for i in range(300):
            try:
                if i % 2:
                    session.apply(time.sleep, 0.005)
                else:  # a lost reply would wait out the 20 s and raise CellTimeout
                    session.run("import time\ntime.sleep(0.005)", sink=ListSink(), timeout=20)
                replied += 1
            except RankError as err:
                assert {f.ename for f in err.failures} == {"KeyboardInterrupt"}, str(err)
                interrupted += 1
    finally:
        stop.set()
        firing.join()
    assert sent[0] > 100
    assert interrupted > 0, "no SIGINT reached the user's code"
    assert replied > 0
    assert session.apply(os.getpid) == pids  # the same processes: none ended
    session.run("after_sigints = rank")
    assert session.pull("after_sigints") == [0, 1]


def test_past_its_timeout_a_cell_waits_for_code_that_caught_the_interrupt_one_grace_only(
    session, tmp_path
):
    """A cell's --timeout holds: code that caught the KeyboardInterrupt and would not end
    gets the one grace an interrupted cell gets, not an unbounded wait; the error names the
    ranks still running it, which run on until interrupted again."""
    from nbdist.driver.runner import CellTimeout

    began = tmp_path / "began"
    began.mkdir()
    handling = "    while True:\n        time.sleep(0.01)\n"
    sink = ListSink()
    with pytest.raises(CellTimeout) as caught:
        session.run(
            _CATCHING_CELL.format(began=str(began), handling=handling), timeout=3, sink=sink
        )
    said = str(caught.value)
    assert "ranks 0-1 still run code that caught the KeyboardInterrupt" in said, said
    notes = [e[3] for e in sink.events if e[0] == "line" and "runs on" in e[3]]
    assert notes and "past --timeout, the cell waits for it 10 s at most" in notes[0], notes
    session.interrupt()  # what the message says to do, here without a cell
    session.run("after = 11")
    assert session.pull("after") == [11, 11]
