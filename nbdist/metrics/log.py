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

Every point after a rank's first carries the step breakdown (``comm_s``,
``data_s``, ``compute_s``, summing to ``step_time``) and every point the rank's
memory (``memory_mib``, ``memory_peak_mib``, on a GPU ``memory_reserved_mib``):
:mod:`nbdist.metrics.steptime` says what each measures. On a rank that uses a
GPU, the last point of a flush also carries the GPU's utilisation, memory and
temperature (:mod:`nbdist.metrics.gpu`), at most once a second;
``NBDIST_LOG_GPU=0`` turns that off, as ``NBDIST_LOG_MEMORY=0`` does the memory keys.

Never blocking, never dropping silently: ``log`` holds its lock only to append
to the buffer; tensors are detached there and read on the flush thread, outside
that lock, so a device sync never stalls a ``log`` call. A rank keeps at most
``NBDIST_LOG_BUFFER`` points (default 50,000) waiting to be sent; a point logged
into a full buffer, or lost to an error, is counted, and every message carries
that count (``dropped``) to the kernel, where ``%dist_status`` and the dashboard
show it.

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

from nbdist.metrics import flops, steptime
from nbdist.metrics.steptime import data_timer

__all__ = ["configure", "data_timer", "dropped", "end_of_cell", "flush", "log", "shutdown"]

# <= 5 flushes a second per rank: the dashboard refreshes at most 5 times a second, and
# every message costs the kernel ~0.3 ms whatever it holds (20 a second per rank cost
# 4 % of a core at 4 ranks).
_FLUSH_INTERVAL_S = 0.2
# Points waiting to be sent, at most (NBDIST_LOG_BUFFER): 250 s of logging at 200 steps/s.
_DEFAULT_BUFFER = 50_000
# Encoded messages the kernel has not taken yet, at most; the oldest go first, counted.
_MAX_UNSENT = 1_000


def _buffer_size() -> int:
    try:
        return max(1, int(os.environ.get("NBDIST_LOG_BUFFER", _DEFAULT_BUFFER)))
    except ValueError:
        return _DEFAULT_BUFFER


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
        # ``lock`` guards the buffer only (held by ``log`` to append); ``send_lock`` orders
        # flushes, and is held while tensors are read, which may wait for the device.
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.pending: list[tuple[int, float, dict]] = []
        self.unsent: list[tuple[list[bytes], int]] = []  # (frames, points in them)
        self.max_pending = _buffer_size()
        self.memory = os.environ.get("NBDIST_LOG_MEMORY", "1") != "0"
        self.total = 0
        self.step = -1
        self.last_call: float | None = None
        # The CUDA device this rank logs from, learnt on the logging thread (CUDA's current
        # device is per thread, and the flush thread's is not the rank's); None until then.
        self.cuda_index: int | None = None
        self.dropped = (
            0  # points lost on this rank: a full buffer, an error; sent with each message
        )
        self.dropped_sent = 0
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
                pass
            if self.unsent:
                self.wake.set()  # the kernel was slow to take them: retry next interval

    def flush(self, marker: dict | None = None) -> None:
        import zmq

        from nbdist.metrics import gpu
        from nbdist.metrics.wire import encode

        with self.send_lock:
            with self.lock:  # only to take the batch: log() never waits for what follows
                batch, self.pending = self.pending, []
            self.max_pending = _buffer_size()
            points = []
            if batch:
                try:
                    points = _to_numbers(batch)  # reads tensors: may wait for the device
                except Exception:
                    with self.lock:
                        self.dropped += len(batch)
            if (
                points
                and self.cuda_index is not None
                and os.environ.get("NBDIST_LOG_GPU", "1") != "0"
            ):
                # A GPU reading rides along at most once a second, whatever the flush rate:
                # each is a few driver calls, and the figures move slower than that.
                target = gpu.cuda_target(self.cuda_index)
                if target is not None:
                    reading = gpu.sampler().fresh(target)
                    points[-1][2].update(gpu.as_point_values(reading))
            dropped = self.dropped
            if points or dropped != self.dropped_sent:
                # "total" counts every point this rank has sent, so the kernel can tell
                # when it has all of them; counted only once the batch is encoded.
                total = self.total + len(points)
                message = {
                    "k": "points",
                    "rank": self.rank,
                    "points": points,
                    "total": total,
                    "dropped": dropped,
                }
                self._queue(encode(self.key, message), len(points))
                self.total, self.dropped_sent = total, dropped
            if marker is not None:
                marker = dict(marker, k="cell", rank=self.rank, total=self.total)
                self._queue(encode(self.key, marker), 0)
            while self.unsent:
                try:
                    self.socket.send_multipart(self.unsent[0][0], flags=zmq.NOBLOCK)
                except zmq.Again:
                    return  # kept; the next flush retries
                self.unsent.pop(0)

    def _queue(self, frames: list[bytes], n: int) -> None:
        if len(self.unsent) >= _MAX_UNSENT:  # the kernel takes nothing: the oldest go, counted
            with self.lock:
                self.dropped += self.unsent.pop(0)[1]
        self.unsent.append((frames, n))

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


# Called with each log call's ``step`` (None when not given), before anything else:
# how other rank-side modules (nbdist.engine.profiling) see steps without an import cycle.
step_hooks: list = []


def log(step: int | None = None, **scalars) -> None:
    """Record metrics for this rank: ``nbdist.log(step=i, loss=loss, samples=len(x))``.

    Values: Python numbers or 0-d tensors (detached now, read later on the flush
    thread, in batches). ``samples`` / ``tokens`` give throughput; the time
    between calls gives ``step_time`` and its breakdown (``comm_s``, ``data_s``,
    ``compute_s``; ``data_time`` = seconds this step waited for data, else the
    time inside :func:`data_timer` blocks). ``flops`` (this step's FLOPs on this
    rank) gives ``tflops`` and ``mfu`` against the device's peak, or against
    ``peak_tflops`` when given (:mod:`nbdist.metrics.flops`). ``step`` defaults
    to one more than the previous call's. Never raises: a bad value is skipped.
    """
    for hook in step_hooks:  # e.g. nbdist.profile counting steps; never raises
        hook(step)
    channel = _channel
    if channel is None:
        return
    try:
        now = resume = time.time()
        comm, data, events = steptime.take()
        if channel.cuda_index is None:
            channel.cuda_index = _cuda_device()
        memory = steptime.memory(channel.cuda_index) if channel.memory else {}
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
        for key, value in scalars.items():
            # No sync; frees the autograd graph now. A tensor outside autograd is kept as
            # it is: detach() would share its storage all the same, for ~2 us a call.
            if not isinstance(value, (int, float)) and getattr(value, "requires_grad", False):
                scalars[key] = value.detach()
        if "data_time" in scalars:
            data = "data_time"  # resolved at flush: it may be a tensor
        with channel.lock:
            if len(channel.pending) >= channel.max_pending:
                channel.dropped += 1
                channel.last_call = resume
                return
            channel.step = channel.step + 1 if step is None else int(step)
            values = dict(scalars)
            values.update(memory)
            if channel.last_call is not None:
                dt = now - channel.last_call
                values["step_time"] = dt
                values[_SPLIT] = (dt, comm, data, events)  # comm_s, data_s, compute_s at flush
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


# The key under which a point waits, until flush, for its step breakdown's parts.
_SPLIT = "__split"


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
        split = values.pop(_SPLIT, None)
        if split is not None:
            dt, comm, data, events = split
            if events:  # CUDA collectives: the device time between their events
                try:
                    comm += steptime.events_seconds(events)
                except Exception:
                    comm = math.nan
            if isinstance(data, str):
                data = _as_float(values.get(data))
            clean.update(steptime.split(dt, comm, data or 0.0))
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


def dropped() -> int:
    """Points this rank logged but could not send (a full buffer, an error); normally 0."""
    channel = _channel
    return 0 if channel is None else channel.dropped


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
