"""Rank side: ``nbdist.log``, cheap to call, never blocks training, never raises into it.

Each call appends one point to a local buffer (values may be Python numbers
or 0-d tensors). A background thread flushes the buffer at most 5 times a
second, and :func:`end_of_cell` flushes it at the end of every cell: the
kernel asks for it in the cell's execute request (a user expression), and the
count it returns, in the execute reply, tells the kernel how many points to
wait for. A cell that logged nothing sends no message at all. Tensor values
are converted at flush time, in one batch per device: turning a CUDA tensor
into a number is a device sync, so doing it per call would stall the training
loop.

``flops=`` gives ``tflops`` and ``mfu``, computed at flush like throughput; the
peak they are measured against is looked up (or measured) once per device,
at the first such call (:func:`nbdist.metrics.flops.log_peak`).

On a rank that uses a GPU, the last point of a flush also carries the GPU's
utilisation, memory and temperature (:mod:`nbdist.metrics.gpu`), at most once
a second; ``NBDIST_LOG_GPU=0`` turns that off, as ``NBDIST_LOG_MEMORY=0`` does
``memory_mib``.

Without a kernel listening (a plain script, or before ``%dist_start``),
``log`` keeps nothing and costs a dictionary build. A script exported by
``%dist_export`` calls :func:`nbdist.engine.standalone.init`, which makes rank 0
the collector: points then go to the run history as in the notebook.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

from nbdist.metrics import flops

__all__ = ["configure", "end_of_cell", "flush", "log", "shutdown"]

# <= 5 flushes a second per rank: the dashboard refreshes at most 5 times a second, and
# every message costs the kernel ~0.3 ms whatever it holds (20 a second per rank cost
# 4 % of a core at 4 ranks).
_FLUSH_INTERVAL_S = 0.2


class _Channel:
    def __init__(self, url: str, key: bytes, rank: int):
        import zmq

        self.rank = rank
        self.key = key
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUSH)
        # PUSH queues (does not drop) while connecting and up to the HWM; the
        # HWM is high so a slow kernel delays points instead of losing them.
        self.socket.setsockopt(zmq.SNDHWM, 1_000_000)
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.connect(url)
        self.lock = threading.Lock()
        self.pending: list[tuple[int, float, dict]] = []
        self.unsent: list[list[bytes]] = []
        self.total = 0
        self.step = -1
        self.last_call: float | None = None
        # The CUDA device this rank logs from, learnt on the logging thread (CUDA's current
        # device is per thread, and the flush thread's is not the rank's); None until then.
        self.cuda_index: int | None = None
        self.dropped = 0
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="nbdist-log-flush", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # Sleeps until a point is logged (an idle rank costs nothing), then
        # flushes at most every _FLUSH_INTERVAL_S while points keep coming.
        last = 0.0
        while not self.stopped:
            self.wake.wait()
            pause = last + _FLUSH_INTERVAL_S - time.monotonic()
            if pause > 0 and not self.stopped:
                time.sleep(pause)
            self.wake.clear()
            last = time.monotonic()
            try:
                self.flush()
            except Exception:  # a broken flush must not kill the thread or the rank
                self.dropped += 1
            if self.unsent:
                self.wake.set()  # the kernel was slow to take them: retry next interval

    def flush(self, marker: dict | None = None) -> None:
        import zmq

        from nbdist.metrics import gpu
        from nbdist.metrics.wire import encode

        with self.lock:
            batch, self.pending = self.pending, []
            if batch:
                points = _to_numbers(batch)
                if os.environ.get("NBDIST_LOG_MEMORY", "1") != "0" and points:
                    points[-1][2]["memory_mib"] = _memory_mib()
                if self.cuda_index is not None and os.environ.get("NBDIST_LOG_GPU", "1") != "0":
                    # A GPU reading rides along at most once a second, whatever the flush rate:
                    # each is a few driver calls, and the figures move slower than that.
                    target = gpu.cuda_target(self.cuda_index)
                    if target is not None:
                        reading = gpu.sampler().fresh(target)
                        points[-1][2].update(gpu.as_point_values(reading))
                # "total" counts every point this rank has sent, so the kernel can tell
                # when it has all of them; counted only once the batch is encoded.
                total = self.total + len(points)
                message = {"k": "points", "rank": self.rank, "points": points, "total": total}
                self.unsent.append(encode(self.key, message))
                self.total = total
            if marker is not None:
                marker = dict(marker, k="cell", rank=self.rank, total=self.total)
                self.unsent.append(encode(self.key, marker))
            while self.unsent:
                try:
                    self.socket.send_multipart(self.unsent[0], flags=zmq.NOBLOCK)
                except zmq.Again:
                    return  # kept; the next flush retries
                self.unsent.pop(0)

    def close(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=2)
        try:
            self.flush()
        finally:
            self.socket.close()
            self.context.term()


_channel: _Channel | None = None


def configure(url: str, key: bytes, rank: int) -> None:
    """Send this rank's points to the collector at ``url`` (called by nbdist)."""
    global _channel
    shutdown()
    _channel = _Channel(url, key, rank)


def shutdown() -> None:
    """Stop sending: flush what is buffered, end the flush thread, close the socket."""
    global _channel
    channel, _channel = _channel, None
    if channel is not None:
        channel.close()


def flush(marker: dict | None = None) -> None:
    """Send the buffered points now, then ``marker`` (if given) as a ``cell`` message.

    Does nothing before :func:`configure` (no collector to send to).
    """
    channel = _channel
    if channel is not None:
        channel.flush(marker)


def log(step: int | None = None, **scalars) -> None:
    """Record metrics for this rank: ``nbdist.log(step=i, loss=loss, samples=len(x))``.

    Values: Python numbers or 0-d tensors (converted later, in batches).
    ``samples`` / ``tokens`` give throughput; the time between calls gives
    ``step_time``. ``flops`` (this step's FLOPs on this rank) gives ``tflops``
    and ``mfu`` against the device's peak, or against ``peak_tflops`` when given
    (:mod:`nbdist.metrics.flops`). ``step`` defaults to one more than the previous call's.
    Never raises: a bad value is skipped.
    """
    channel = _channel
    if channel is None:
        return
    try:
        now = resume = time.time()
        if channel.cuda_index is None:
            channel.cuda_index = _cuda_device()
        peak = scalars.pop("peak_tflops", None)
        if "flops" in scalars:
            if peak is None:
                peak = flops.known_peak(channel.cuda_index)
            if peak is None:  # once per device: the table, or a measurement (<= ~1 s)
                peak = flops.log_peak(channel.cuda_index)
                resume = time.time()  # time spent measuring is not the next step's
            peak = _as_float(peak)
            if peak is not None and not (peak > 0 and math.isfinite(peak)):
                peak = None
        with channel.lock:
            channel.step = channel.step + 1 if step is None else int(step)
            values = dict(scalars)
            if channel.last_call is not None:
                dt = now - channel.last_call
                values["step_time"] = dt
                for key in ("samples", "tokens"):
                    if key in values and dt > 0:
                        values[f"{key}_per_s"] = (key, dt)  # resolved at flush (tensor-safe)
                if "flops" in values and dt > 0:
                    values["tflops"] = ("flops", dt * 1e12)
                    if peak:
                        values["mfu"] = ("flops", dt * 1e12 * float(peak))
            channel.last_call = resume
            channel.pending.append((channel.step, now, values))
            if len(channel.pending) == 1:
                channel.wake.set()  # the flush thread sleeps until there is something to send
    except Exception:
        channel.dropped += 1


def _to_numbers(batch: list[tuple[int, float, dict]]) -> list[list]:
    """Points with every value a float; tensors converted in one batch per device."""
    tensors = {}
    for _, _, values in batch:
        for key, value in values.items():
            if not isinstance(value, (int, float, tuple)) and hasattr(value, "detach"):
                tensors.setdefault(str(value.device), []).append((values, key, value))
    if tensors:
        import torch

        for items in tensors.values():
            try:
                stacked = torch.stack([v.detach().reshape(()).float() for _, _, v in items])
                numbers = stacked.cpu().tolist()  # one device sync for the whole batch
            except Exception:
                numbers = [math.nan] * len(items)
            for (values, key, _), number in zip(items, numbers):
                values[key] = number
    out = []
    for step, when, values in batch:
        clean = {}
        for key, value in values.items():
            if isinstance(value, tuple):  # ("samples", dt) -> samples / dt
                source, scale = value
                value = _as_float(values.get(source))
                value = None if value is None else value / scale
            number = _as_float(value)
            if number is not None:
                # NaN is not JSON: sent as null, read back as NaN by the kernel.
                clean[key] = None if math.isnan(number) else number
        out.append([step, when, clean])
    return out


def _as_float(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _cuda_device() -> int | None:
    # Never initialises CUDA: a rank that has not used CUDA yet is asked again next call.
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
    except Exception:
        pass
    return None


def _memory_mib() -> float:
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return torch.cuda.max_memory_allocated() / 2**20
    except Exception:
        pass
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return math.nan


def end_of_cell() -> int | None:
    """Send what this cell logged now; the number of points this rank has sent in all.

    Evaluated on every rank right after a cell, as a user expression of the
    cell's execute request: the kernel reads the count from the execute reply
    and waits until that many points of the rank have arrived. None when this
    rank sends no metrics (nothing to wait for).
    """
    channel = _channel
    if channel is None:
        return None
    try:
        # Always through the lock: a flush in progress on the flush thread has taken
        # its batch from ``pending`` but not yet counted it in ``total``.
        channel.flush()
    except Exception:  # a batch that cannot be encoded is not counted, so never awaited
        channel.dropped += 1
    return channel.total
