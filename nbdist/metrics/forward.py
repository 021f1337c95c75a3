"""Kernel side: every point of a run handed to a user callback (W&B, MLflow...), on a thread of its own.

The ranks never wait for the callback: points reach the kernel as they always
do, the collector queues them here, and one thread calls ``callback(point)``
for each, in arrival order per rank. A slow tracker (``wandb.log`` takes
~0.1-1 ms a call) only lets the queue grow; :meth:`Forwarder.close` sends what
is queued, then stops. Example, W&B::

    import wandb
    wandb.init(project="nbdist-demo")
    fwd = session.metrics.forward(lambda p: wandb.log(p.values, step=p.step), ranks=[0])

MLflow::

    import mlflow
    mlflow.start_run()
    fwd = session.metrics.forward(lambda p: mlflow.log_metrics(p.values, step=p.step), ranks=[0])

Every rank, one series per rank: ``lambda p: wandb.log({f"rank{p.rank}/{k}": v for k, v in
p.values.items()}, step=p.step)``. A callback that raises is counted
(:attr:`Forwarder.errors`, the first exception in :attr:`Forwarder.error`, one
warning); forwarding goes on with the next point.
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

__all__ = ["ForwardedPoint", "Forwarder"]


class ForwardedPoint(NamedTuple):
    """One logged point as a callback gets it: ``values`` maps each key to a float."""

    rank: int
    step: int
    time: float
    values: dict


class Forwarder:
    """Calls ``callback(point)`` for each new point of ``run`` (of ``ranks``, default all)."""

    def __init__(
        self,
        run,
        callback: Callable[[ForwardedPoint], object],
        *,
        ranks: Iterable[int] | None = None,
    ):
        """Start forwarding the points that arrive from now on (see the module docstring)."""
        if not callable(callback):
            raise TypeError(
                f"callback must be callable, got {callback!r}: e.g. lambda p: wandb.log(p.values, step=p.step)"
            )
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.callback = callback
        self.forwarded = 0
        self.errors = 0
        self.error: BaseException | None = None
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="nbdist-forward", daemon=True)
        self._thread.start()
        self._unsubscribe = run.on_points(self._take)

    def _take(self, rank: int, points: list) -> None:
        # On the collector's thread: only queue, never call the user's code here.
        if self.ranks is not None and rank not in self.ranks:
            return
        with self._wake:
            self._queue.append((rank, points))
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                rank, points = self._queue.popleft()
                self._busy = True
            for step, when, values in points:
                try:
                    self.callback(ForwardedPoint(rank, int(step), float(when), dict(values)))
                    self.forwarded += 1
                except Exception as exc:
                    self.errors += 1
                    if self.error is None:
                        self.error = exc
                        warnings.warn(
                            f"nbdist: the metrics callback {self.callback!r} raised {exc!r}; "
                            "later points are still forwarded (Forwarder.errors counts them)",
                            stacklevel=1,
                        )
            with self._wake:
                self._busy = False
                self._wake.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every point queued so far went to the callback; False on timeout."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self, timeout: float | None = 10.0) -> None:
        """Stop taking points, hand the queued ones to the callback (``timeout`` s at most)."""
        self._unsubscribe()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> Forwarder:
        """``with run.forward(cb): ...`` closes it at the end of the block."""
        return self

    def __exit__(self, *exc) -> None:
        """Close (see :meth:`close`)."""
        self.close()
