"""Rank side: ``nbdist.log``, cheap to call, never blocks training, never raises into it.

Each call stamps the time, takes the step's collective and data timers, and
appends the point's fields to a local buffer, a list per field (values may be
Python numbers or 0-d tensors), so a call leaves no object of its own for the
garbage collector; everything derived from it (step time and its breakdown,
throughput, TFLOP/s, memory on every point, device tensors' values) is worked
out later on the flush thread, for a whole batch at once
(:mod:`nbdist.metrics.batch`), and sent as columns (:mod:`nbdist.metrics.wire`). That thread sleeps until a point is logged, then flushes at most
twice a second, and :func:`end_of_cell` flushes at the end of every cell: the
count it returns, in the cell's execute reply, tells the kernel how many points
to wait for. A cell that logged nothing sends no message at all.

How a tensor's value is read, and when: a CPU tensor at the call (``item()``,
~1 us, nothing to wait for: kept until the flush, every step's 0-d tensor made
the heap give the step's large buffers back to the system and fault them in
again, bench/RESULTS.md). A device tensor never on the training thread: it is
only detached there (when it requires grad: that frees its graph). At the next
flush (<= 0.5 s later, or the end of the cell) the flush thread stacks the
batch's device tensors, one ``torch.stack`` per device, and copies the result to
the host: for a CUDA loss that copy is the one device sync per flush, on the
flush thread, which waits for the kernels queued before it while the training
thread goes on queueing. A loss turned into a number by the user
(``loss.item()``) was synced by the user, where they asked for it.

``flops=`` gives ``tflops`` and ``mfu``, computed at flush like throughput; the
peak they are measured against is looked up (or measured) once per device,
at the first such call (:func:`nbdist.metrics.flops.log_peak`).

Every point after a rank's first carries the step breakdown (``comm_s``,
``data_s``, ``compute_s``, summing to ``step_time``) and every point the rank's
memory (``memory_mib``, ``memory_peak_mib``, on a GPU ``memory_reserved_mib``):
:mod:`nbdist.metrics.steptime` says what each measures. Memory is read on the
flush thread, once per flush (at most twice a second, and at the end of every
cell), and every point of the batch carries that reading: read on the training
thread, even every 20 ms, it cost a step 20-35 us each time (the system calls
and the cold caches a training step leaves, bench/RESULTS.md); the
``memory_peak_mib`` high-water mark misses nothing in between. On a rank that uses a
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
``log`` keeps nothing and costs a dictionary build; in a process forked from a rank
(a DataLoader worker) it keeps nothing and warns once. A script exported by
``%dist_export`` calls :func:`nbdist.engine.standalone.init`, which makes rank 0
the collector: points then go to the run history as in the notebook.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings

from nbdist.metrics import flops, steptime
from nbdist.metrics.batch import PEAK as _PEAK
from nbdist.metrics.batch import Points, to_columns
from nbdist.metrics.steptime import data_timer
from nbdist.metrics.steptime import timers as _timers

__all__ = [
    "configure",
    "data_timer",
    "dropped",
    "end_of_cell",
    "flush",
    "log",
    "new_cell",
    "shutdown",
]

# <= 2 flushes a second per rank, so a point is in the kernel (and on the dashboard) within
# ~0.5 s. Each flush wakes a thread that, with every core busy training, preempts a training
# thread: at two ranks on two cores, 5 flushes a second cost each training thread ~70 us of CPU
# per step at 1.6 ms steps, 2 a second ~16-26 us (bench/RESULTS.md). Every message also costs
# the kernel ~0.3 ms whatever it holds.
_FLUSH_INTERVAL_S = 0.5
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
        # A DEALER sends as a PUSH would (one peer: the collector's ROUTER) and can hear
        # the answer to a sync. It queues (does not drop) while connecting and up to the
        # HWM; the HWM is high so a slow kernel delays points instead of losing them.
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.SNDHWM, 1_000_000)
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.connect(url)
        # ``lock`` guards the buffer only (held by ``log`` to append); ``send_lock`` orders
        # flushes, and is held while tensors are read, which may wait for the device.
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.pending = Points()
        self.unsent: list[tuple[list[bytes], int]] = []  # (frames, points in them)
        self.max_pending = _buffer_size()
        self.memory = os.environ.get("NBDIST_LOG_MEMORY", "1") != "0"
        self.total = 0
        self.syncs = 0  # sync messages sent: each answer names its own
        # The CUDA device this rank logs from, learnt on the logging thread (CUDA's current
        # device is per thread, and the flush thread's is not the rank's); None until then.
        # Looked for by the first point of each batch (at most twice a second while points
        # come, so the call itself stays a few reads and appends) and before a peak lookup.
        self.cuda_index: int | None = None
        self.dropped = (
            0  # points lost on this rank: a full buffer, an error; sent with each message
        )
        self.dropped_sent = 0
        # What the user is told once per key (batch.what_it_was): a value that was no number
        # ("loss": "'high' (a str)"), and under "" the first error that dropped whole points.
        self.left_out: dict[str, str] = {}
        self.left_out_unsent: dict[str, str] = {}
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

    def flush(self, marker: dict | None = None, wait_s: float = 0.0) -> bool:
        import zmq

        from nbdist.metrics import gpu
        from nbdist.metrics.wire import encode, points_message

        with self.send_lock:
            fresh = Points()
            with self.lock:  # only to take the batch: log() never waits for what follows
                batch, self.pending = self.pending, fresh
            fresh.follow(batch)  # read at fresh's own flush, after this one (send_lock)
            self.max_pending = _buffer_size()
            n, steps, times, columns = 0, [], (), {}
            if batch.n:
                try:
                    reading = steptime.memory(self.cuda_index) if self.memory else {}
                    _yield_gil()
                    # Reads tensors (may wait for the device) and fills in what log() left
                    # for later: step time, its breakdown, throughput, memory.
                    left_out: dict[str, str] = {}
                    steps, times, columns = to_columns(batch, reading, left_out)
                    n = batch.n
                    if left_out:
                        self.tell(left_out)
                    _yield_gil()
                except Exception:
                    with self.lock:
                        self.dropped += batch.n
            if n and self.cuda_index is not None and os.environ.get("NBDIST_LOG_GPU", "1") != "0":
                # A GPU reading rides along at most once a second, whatever the flush rate:
                # each is a few driver calls, and the figures move slower than that.
                target = gpu.cuda_target(self.cuda_index)
                if target is not None:
                    reading = gpu.sampler().fresh(target)
                    for key, value in gpu.as_point_values(reading).items():  # the last point
                        columns[key] = ([n - 1], [value])
            dropped = self.dropped
            told = {}
            if self.left_out_unsent:  # rare: not worth the lock on every flush otherwise
                with self.lock:
                    told, self.left_out_unsent = self.left_out_unsent, {}
            if n or dropped != self.dropped_sent or told:
                # "total" counts every point this rank has sent, so the kernel can tell
                # when it has all of them; counted only once the batch is encoded.
                total = self.total + n
                message = points_message(self.rank, steps, times, columns, total, dropped)
                if told:
                    message["left_out"] = told
                _yield_gil()
                self._queue(encode(self.key, message), n)
                self.total, self.dropped_sent = total, dropped
            if marker is not None:
                marker = dict(marker, k="cell", rank=self.rank, total=self.total)
                self._queue(encode(self.key, marker), 0)
            while self.unsent:
                try:
                    self.socket.send_multipart(self.unsent[0][0], flags=zmq.NOBLOCK)
                except zmq.Again:
                    return False  # kept; the next flush retries
                self.unsent.pop(0)
            return self._synced(wait_s) if wait_s > 0 else True

    def _synced(self, wait_s: float) -> bool:
        """Whether the collector answered a sync within ``wait_s``: it has then taken
        every message sent before (a socket's send only queues it for zmq's I/O thread,
        so a rank killed right after a flush could lose it on a loaded machine)."""
        import zmq

        from nbdist.metrics.wire import encode

        self.syncs += 1
        want = str(self.syncs).encode()
        sync = {"k": "sync", "rank": self.rank, "seq": self.syncs}
        try:
            self.socket.send_multipart(encode(self.key, sync), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return False
            answer = self.socket.recv_multipart()
            if answer == [b"synced", want]:  # an earlier, late answer is passed over
                return True
        return False

    def tell(self, left_out: dict[str, str]) -> None:
        """Send each key's description with the next message, once per key for this rank."""
        with self.lock:  # from the training thread too (a dropped point)
            for key, what in left_out.items():
                if key not in self.left_out:
                    self.left_out[key] = self.left_out_unsent[key] = what

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


def _yield_gil() -> None:
    # The flush thread's work is Python holding the GIL; a training thread coming back from
    # a torch op (which ran without it) waits for it, on its own core, until the holder lets
    # go or CPython's switch interval (5 ms) forces it. Letting go between the stages of a
    # flush bounds that wait by a stage instead of the whole flush: with a core to spare,
    # the wall time a flush took from training fell from 0.44-0.54 to 0.16-0.28 ms
    # (bench/log_call.py --flushes, bench/RESULTS.md).
    time.sleep(0)


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


def flush(marker: dict | None = None, *, wait_s: float = 0.0) -> bool:
    """Send the buffered points now, then ``marker`` (if given) as a ``cell`` message.

    With ``wait_s``, wait (at most that long) until the kernel's collector says it has
    taken them: a rank killed after that keeps its points (:func:`nbdist.checkpoint.save`
    waits so). Returns False if it did not say so in time (the points stay on their
    way, as after any flush). Does nothing before :func:`configure` (no collector).
    """
    channel = _channel
    if channel is not None:
        return channel.flush(marker, wait_s)
    return True


# Called with each log call's ``step`` (None when not given), before anything else:
# how other rank-side modules (nbdist.engine.profiling) see steps without an import cycle.
step_hooks: list = []
# Run by end_of_cell first, e.g. nbdist.profile stopping a profile its cell left running; never raise.
cell_end_hooks: list = []


def log(step: int | None = None, **scalars) -> None:
    """Record metrics for this rank: ``nbdist.log(step=i, loss=loss, samples=len(x))``.

    Values: Python numbers or 0-d tensors (a CPU tensor read now; a device tensor
    detached now, read on the flush thread, in batches: no sync here). ``samples`` / ``tokens`` give throughput; the time
    between calls in one cell gives ``step_time`` (not the first call of a cell:
    :func:`new_cell`) and its breakdown (``comm_s``, ``data_s``,
    ``compute_s``; ``data_time`` = seconds this step waited for data, else the
    time inside :func:`data_timer` blocks). ``flops`` (this step's FLOPs on this
    rank) gives ``tflops`` and ``mfu`` against the device's peak, or against
    ``peak_tflops`` when given (:mod:`nbdist.metrics.flops`). ``step`` defaults
    to one more than the previous call's. Never raises: a value that is no number
    is left out of the point (its key, and the value, shown once under the
    dashboard), and a ``step`` that is no whole number drops the point (counted, and
    the first error shown).

    Reserved names: ``time`` and ``rank`` are every point's own (when it was
    logged, the rank that logged it), and nbdist works out ``step_time``, its
    breakdown (``compute_s``, ``comm_s``, ``data_s``), ``samples_per_s``,
    ``tokens_per_s``, ``tflops``, ``mfu`` and the memory and GPU figures itself,
    so a value logged under one of those is left out of the point and shown once
    under the dashboard like a value that is no number: log it under another name
    (``elapsed_s=elapsed``, ``my_step_time=t``). ``step`` is this function's own
    argument. (:data:`nbdist.metrics.batch.RESERVED_KEYS`)
    """
    for hook in step_hooks:  # e.g. nbdist.profile counting steps; never raises
        hook(step)
    channel = _channel
    if channel is None:
        return
    if not _timers.armed:  # this cell's CUDA collectives are timed from here on
        _timers.armed = True
    # The training loop's own work evicts from the caches whatever this call touches, so
    # each object and call here costs a cache miss per step: the call only stamps the
    # time, takes the step's collective/data timers and appends each field to its list;
    # everything derived (step time, its breakdown, throughput, memory, tensor values) is
    # worked out on the flush thread. Nothing it keeps is a new object the garbage
    # collector tracks (a tuple and a dict per point were: the collections they caused ran
    # on this thread, bench/RESULTS.md).
    try:
        now = time.time()
        if _timers.dirty:  # a collective or a data timer since the last call
            comm, data, events = steptime.take()
        else:
            comm = data = events = None
        resume = now
        if "flops" in scalars or "peak_tflops" in scalars:
            resume = _flops_peak(channel, scalars, resume)
        if step is not None and step.__class__ is not int:
            # Read once (a tensor's .item(), as int() would); 7.5 or '8' would be placed
            # at another step.
            number = step.item() if hasattr(step, "item") else step
            whole = int(number)
            if whole != number:
                raise ValueError(f"step {step!r} is no whole number")
            step = whole
        lock = channel.lock
        lock.acquire()  # (not ``with``: two special-method lookups fewer on the hot path)
        try:
            points = channel.pending
            i = points.n
            if i >= channel.max_pending:
                channel.dropped += 1
                if i:  # the next kept point's step time counts from this call
                    points.resumes[i - 1] = resume
                return
            cols = points.cols
            for key, value in scalars.items():
                if value.__class__ not in _PLAIN:
                    value = _hold(value)
                values = cols.get(key)
                if values is not None and len(values) == i:  # a key on every point so far
                    values.append(value)
                elif i == 0:
                    cols[key] = [value]
                else:
                    points.add_sparse(key, i, value)
            points.steps.append(step)
            points.times.append(now)
            if resume is not now:
                points.resumes[i] = resume
            if comm:
                points.comm[i] = comm
            if data:
                points.data[i] = data
            if events:
                points.events[i] = events
            points.n = i + 1
            if i == 0:
                channel.wake.set()  # the flush thread sleeps until there is something to send
                if channel.cuda_index is None:  # on this thread: CUDA's device is per thread
                    channel.cuda_index = _cuda_device()
        finally:
            lock.release()
    except Exception as exc:
        channel.dropped += 1
        if "" not in channel.left_out:  # the first such error, told once (flush thread sends it)
            try:
                channel.tell({"": f"{type(exc).__name__}: {exc}"[:200]})
            except Exception:
                pass


_PLAIN = frozenset((int, float, bool))


def _hold(value):
    """What the buffer keeps of a value that is no Python number (never raises)."""
    if getattr(value, "is_cpu", False):
        # A CPU tensor is read now: no device to wait for (~1 us). Kept until the flush,
        # the 0-d tensors of every step pinned small blocks all over the heap, and the
        # step's own large buffers were given back to the system and faulted in again:
        # 2.6-6.5 page faults and +60-150 us of training thread CPU a step
        # (bench/RESULTS.md, "two ranks").
        try:  # item(), not float(): float() of a tensor in autograd warns
            return float(value.item())
        except Exception:  # not one element: read (as NaN) at the flush
            return value
    # A device tensor: no sync here; frees the autograd graph now. Outside autograd it is
    # kept as it is (detach() would share its storage all the same, ~2 us).
    if getattr(value, "requires_grad", False):
        try:
            return value.detach()
        except Exception:
            return value
    return value


def _flops_peak(channel: _Channel, scalars: dict, resume: float) -> float:
    """Put the peak TFLOP/s ``mfu`` is measured against into ``scalars`` (as
    ``__peak``); returns when the step resumes (a first measurement takes up to ~1 s)."""
    peak = scalars.pop("peak_tflops", None)
    if "flops" not in scalars:
        return resume
    if channel.cuda_index is None:  # the peak is the device's: know the device first
        channel.cuda_index = _cuda_device()
    if peak is None:
        peak = flops.known_peak(channel.cuda_index)
    if peak is None:  # once per device: the table, or a measurement (<= ~1 s)
        peak = flops.log_peak(channel.cuda_index)
        resume = time.time()  # time spent measuring is not the next step's
    peak = _as_float(peak)
    if peak is not None and peak > 0 and math.isfinite(peak):
        scalars[_PEAK] = peak
    return resume


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


# A process forked from a rank (a DataLoader worker, a fork Process) holds a copy of the
# channel with no flush thread (threads do not survive a fork), a zmq socket it must not
# use, and a buffer lock the rank's flush thread may have held at the fork (a log call there
# would wait for ever). There log records nothing and says so once; the parent's channel is
# kept so that the child never closes what it shares with the rank.
_forked_from: _Channel | None = None


def _after_fork_in_child() -> None:
    global _channel, _forked_from
    channel, _channel = _channel, None
    if channel is None:
        return
    _forked_from = channel
    said: list = []

    def say_once(step) -> None:
        if said:
            return
        said.append(step)
        try:
            # The same words on every rank and child, so that a notebook folds them into
            # one line ("[ranks 0-255] ..."); the line's label names the rank.
            warnings.warn(
                "nbdist.log records nothing in a process forked from a rank (a DataLoader "
                "worker, a multiprocessing child): only the rank's own process sends points; "
                "log in its training loop",
                RuntimeWarning,
                stacklevel=3,
            )
        except Exception:  # noqa: BLE001 - warnings made errors must not fail the child's code
            pass

    step_hooks.append(say_once)


os.register_at_fork(after_in_child=_after_fork_in_child)


def dropped() -> int:
    """Points this rank logged but could not send (a full buffer, an error); normally 0."""
    channel = _channel
    return 0 if channel is None else channel.dropped


def new_cell() -> None:
    """A cell begins on this rank (IPython's ``pre_execute``): its first point starts afresh.

    A point's step time is the time since the previous call of :func:`log`. Across
    cells that is the pause between them as well (the user reading, editing), so the
    first point of the next training cell took minutes as its step: its throughput
    near 0, the breakdown's compute bar minutes high for the 20 points it averages.
    The first point of a cell has no step time, as the rank's first point has none;
    steps still count on. Until the cell logs, its collectives on CUDA tensors get
    no timing events (:func:`nbdist.metrics.steptime.cell_begins`).
    """
    steptime.cell_begins()
    channel = _channel
    if channel is None:
        return
    with channel.send_lock:  # after the flush that set the buffer's first_last
        with channel.lock:
            if not channel.pending.n:  # a point logged by a thread meanwhile keeps it
                channel.pending.first_last = None


def end_of_cell() -> int | None:
    """Send what this cell logged now; the number of points this rank has sent in all.

    Evaluated on every rank right after a cell, as a user expression of the
    cell's execute request: the kernel reads the count from the execute reply
    and waits until that many points of the rank have arrived. None when this
    rank sends no metrics (nothing to wait for).
    """
    for hook in list(cell_end_hooks):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a hook's failure must not fail the user's cell
            pass
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
