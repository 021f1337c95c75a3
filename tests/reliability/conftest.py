"""Real kernels for the reliability tests, with helpers to find and time the processes nbdist started."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from tests.conftest import _alive
from tests.notebooks.conftest import Kernel


class EnvKernel(Kernel):
    """A :class:`Kernel` (optionally with its own environment) that lists what it started."""

    def descendants(self) -> list[int]:
        """Every process below the kernel: what nbdist started (the kernel starts nothing else)."""
        return sorted(p.pid for p in psutil.Process(self.pid).children(recursive=True))


class DeathClock:
    """Notes the moment a process ends, from a thread (its parent may be busy restarting it)."""

    def __init__(self, pid: int) -> None:
        self.ended: float | None = None
        self._proc = psutil.Process(pid)
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            self._proc.wait(timeout=300)
        except psutil.Error:
            pass
        self.ended = time.monotonic()

    def wait(self, timeout: float = 120) -> float:
        self._thread.join(timeout)
        assert self.ended is not None, f"process {self._proc.pid} still runs after {timeout} s"
        return self.ended


def survivors(pids, *, until: float) -> list[str]:
    """PIDs among ``pids`` alive at monotonic time ``until`` (waits for it), with command lines."""
    alive = list(pids)
    while True:
        alive = [p for p in alive if _alive(p)]
        if not alive or time.monotonic() >= until:
            break
        time.sleep(0.1)
    out = []
    for pid in alive:
        try:
            out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:160]}")
        except psutil.Error:
            pass
    return out


@pytest.fixture
def kernels():
    """``kernels(env=None)`` starts an :class:`EnvKernel`; all are shut down after the test."""
    started: list[EnvKernel] = []

    def start(env: dict[str, str] | None = None) -> EnvKernel:
        kernel = EnvKernel(env)
        started.append(kernel)
        return kernel

    yield start
    for kernel in started:
        kernel.shutdown()
