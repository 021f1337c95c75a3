"""Which main thread counts as held in C++ after a release: asleep, not computing (real threads).

After a release the kernel ends a rank whose main thread waits in C++ (DDP's backward, a
work's wait()) for a call gloo never finishes. A rank that computes in C++ (a matrix
product begun before the release), or runs bytecode, must never count: ending it would
lose its state for nothing. Here the test's own main thread plays the rank's, and a
second thread the rank's control thread, which marks the release and then looks.
"""

from __future__ import annotations

import threading
import time

import torch

from nbdist.engine import held_collective


def _look_while_main(call) -> tuple[bool, float, float]:
    """Mark a release 0.1 s into ``call`` (run on the main thread), look 0.2 s later.

    Returns what the look said, when it said it, and when ``call`` returned.
    """
    said: dict = {}

    def control():
        time.sleep(0.1)
        held_collective.mark_released()
        time.sleep(0.2)
        said["asleep"] = held_collective.asleep_since_release()
        said["at"] = time.monotonic()

    thread = threading.Thread(target=control)
    thread.start()
    try:
        call()
        returned = time.monotonic()
    finally:
        thread.join()
        held_collective.forget_release()
    return said["asleep"], said["at"], returned


def test_a_main_thread_asleep_in_one_native_call_since_the_release_counts():
    asleep, at, returned = _look_while_main(lambda: time.sleep(2.0))
    assert at < returned
    assert asleep


def test_a_main_thread_computing_in_one_native_call_does_not_count():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # 137 GFLOP: 1.5 s on one core here; over before the look's end (0.35 s) only at
        # 390 GFLOP/s, above any CPU core's float32 peak.
        a = torch.randn(4096, 4096)
        asleep, at, returned = _look_while_main(lambda: torch.mm(a, a))
    finally:
        torch.set_num_threads(threads)
    # The product still ran when the look came: the same frame, the same instruction, but
    # the CPU clock moved.
    assert at < returned
    assert not asleep


def test_a_main_thread_that_ran_bytecode_since_the_release_does_not_count():
    def naps():
        for _ in range(20):  # each nap asleep, but bytecode runs between them
            time.sleep(0.05)

    asleep, at, returned = _look_while_main(naps)
    assert at < returned
    assert not asleep


def test_nothing_counts_without_a_release():
    assert held_collective.held(True) is None
    assert not held_collective.asleep_since_release()
