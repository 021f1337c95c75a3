"""Kernel side: the receiving end of ``nbdist.log``, receive every rank's points, keep them, store them.

One ROUTER socket per session, bound to loopback unless the ranks are on other
hosts. A thread receives, checks each message's signature (the cluster key)
before decoding it, adds the points to the in-memory :class:`Run` (which
dashboards watch) and appends them to the run history. A rank that must know
its points arrived (``nbdist.checkpoint.save``: a rank killed right after a
save must not leave a hole before it) sends a ``sync`` message after them and
waits for the answer: messages from one rank arrive in order, so by the time
the collector answers, it has taken every point sent before.

After a cell the session waits until every rank's points of that cell have
arrived: each points message carries the rank's running count of points sent,
and the execute reply carries the count the rank had reached at the end of the
cell. A standalone script (no execute replies) ends with a marker message
instead; messages from one sender arrive in order, so its points came first.

Wherever a session stops taking points from its ranks (``stop``, and the new
key of a restart, :meth:`Collector.new_cluster`), the collector first drains
what is already on its socket: it keeps receiving until one poll interval
passes without a message, or ``DRAIN_CAP_S`` seconds at most, so stopping never
waits long and never throws away points that had already arrived. What a rank
could not send is counted on the rank (``dropped`` in its messages, kept in
:attr:`Run.dropped <nbdist.metrics.run.Run.dropped>`).
"""

from __future__ import annotations

import threading
import time

from nbdist.metrics.run import Run
from nbdist.metrics.store import RunStore
from nbdist.metrics.wire import columns, decode

__all__ = ["DRAIN_CAP_S", "Collector"]

# Under a steady stream, the history is committed at least this often.
_COMMIT_EVERY_S = 1.0
# The longest a stop (or a restart's new key) waits for points already on their way.
DRAIN_CAP_S = 2.0
_POLL_MS = 100


class Collector:
    """Receives metrics for one run; ``url`` is what ranks connect to."""

    def __init__(self, key: bytes, run: Run, store: RunStore | None, *, ip: str = "127.0.0.1"):
        """Bind a random port on ``ip`` and start the receiving thread.

        ``key``: the cluster key messages must be signed with; ``run``: where the
        points go; ``store``: the history they are appended to (None: memory only).
        """
        import zmq

        self.key = key
        self.run = run
        self.store = store
        # Messages with a bad signature or shape, or that raised: dropped, the stream goes
        # on; the run keeps the first error of those it could not read (Run.kernel_losses).
        self.rejected = 0
        self.store_errors = 0
        self._context = zmq.Context()
        # ROUTER: the ranks' DEALERs send as a PUSH would, and a sync is answered to its rank.
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{ip}")
        self.url = f"tcp://{ip}:{port}"
        self._cells: dict[int, int] = {}  # rank -> last cell marker seen
        self._received: dict[int, int] = {}  # rank -> highest running count of points seen
        self._cond = threading.Condition()
        self._messages = 0  # messages taken since the last new_cluster: nothing to drain if 0
        self._quiet = 0  # polls that found the socket empty (drain waits for a fresh one)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbdist-collector", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        committed, dirty = time.monotonic(), False
        while not self._stopping.is_set():
            got = poller.poll(_POLL_MS)
            if not got:
                with self._cond:
                    self._quiet += 1
                    self._cond.notify_all()
            if got:
                while True:
                    try:
                        identity, *frames = self._socket.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        dirty = self._handle(frames, identity) or dirty
                    except Exception as exc:
                        # A message of a shape _handle did not foresee (or a bug in it)
                        # must not end the thread: that would silently end every rank's
                        # metrics for the rest of the session. Dropped, counted, shown.
                        self.rejected += 1
                        self.run.note_kernel_loss("unread", exc)
            # A commit per message cost more than everything else the collector does
            # (~0.5 ms each): commit after 100 ms of quiet, or every _COMMIT_EVERY_S.
            if dirty and (not got or time.monotonic() - committed > _COMMIT_EVERY_S):
                self._commit()
                committed, dirty = time.monotonic(), False
        if dirty:
            self._commit()

    def commit(self) -> None:
        """Make what arrived so far visible to readers of the history (the session calls
        this at the end of each cell)."""
        self._commit()

    def _commit(self) -> None:
        if self.store is not None:
            try:
                self.store.commit()
            except Exception as exc:
                self.store_errors += 1
                self.run.note_kernel_loss("unstored", exc)

    def _handle(self, frames: list[bytes], identity: bytes = b"") -> bool:
        """Take one message (from the rank connected as ``identity``); True if it added
        rows to the history."""
        self._messages += 1
        message = decode(self.key, frames)
        rank = message.get("rank") if message else None
        if not isinstance(rank, int):
            self.rejected += 1
            return False
        kind = message.get("k")
        if kind == "points":
            # Signed by our own ranks, so trusted to be columns of numbers (wire.columns);
            # only JSON's null (a NaN on the rank) needs turning back into NaN.
            try:
                steps, times, cols = columns(message)
            except (KeyError, TypeError, ValueError) as exc:  # a shape this kernel cannot read
                self.rejected += 1
                self.run.note_kernel_loss("unread", exc)
                return False
            self.run.record_losses(rank, message)
            if steps:
                self.run.add_columns(rank, steps, times, cols)
            stored = False
            # A message that only raises the dropped count, or tells of a value left out, is
            # stored too (n = 0), so the history keeps what was lost, not only what arrived.
            if self.store is not None and (
                steps or message.get("dropped") or "left_out" in message
            ):
                try:  # stored as it arrived (verified JSON): one row per batch, no re-encoding
                    self.store.append(self.run.id, rank, frames[1].decode(), len(steps))
                    stored = True
                except Exception as exc:  # a full disk must not stop live metrics
                    self.store_errors += 1
                    self.run.note_kernel_loss("unstored", exc)
            # Counted only now: a cell that waits for these points then commits them.
            total = message.get("total")
            if isinstance(total, int):
                with self._cond:
                    self._received[rank] = max(self._received.get(rank, 0), total)
                    self._cond.notify_all()
            return stored
        elif kind == "sync":
            # Everything this rank sent before it has been taken (one connection, in order).
            self._socket.send_multipart([identity, b"synced", str(message.get("seq")).encode()])
            return False
        elif kind == "cell":
            with self._cond:
                self._cells[rank] = max(self._cells.get(rank, -1), int(message.get("cell", -1)))
                self._cond.notify_all()
        else:
            self.rejected += 1

    def new_cluster(self, key: bytes) -> None:
        """Fresh ranks (a restart): they sign with a new key and count from 0 again.

        Without forgetting the old counts (points sent, script end markers), what
        the old ranks had reached would count as arrived for the new ranks, and
        the end of a cell would not wait for their points.
        """
        self.drain()  # the old ranks' last points, under the old key
        with self._cond:
            self.key = key
            self._messages = 0
            self._cells.clear()
            self._received.clear()

    def wait_for_cells(self, cells: dict[int, int], timeout: float = 2.0) -> bool:
        """Wait until each rank's marker for its cell number arrived; False on timeout."""
        return self._wait(self._cells, cells, -1, timeout)

    def wait_for_points(self, totals: dict[int, int], timeout: float = 2.0) -> bool:
        """Wait until each rank's running count of points reached its total; False on timeout."""
        return self._wait(self._received, totals, 0, timeout)

    def _wait(
        self, seen: dict[int, int], wanted: dict[int, int], none: int, timeout: float
    ) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(seen.get(rank, none) < value for rank, value in wanted.items()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def drain(self, cap: float = DRAIN_CAP_S) -> bool:
        """Receive what is on the socket already: until one poll finds it empty, ``cap`` s at most.

        True when the socket went quiet; at once when no message ever arrived.
        """
        if not self._messages or not self._thread.is_alive():
            return True
        deadline = time.monotonic() + cap
        with self._cond:
            # A poll that began before this call may end empty while a message waits: two.
            wanted = self._quiet + 2
            while self._quiet < wanted:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(remaining, 2 * _POLL_MS / 1000))
        return True

    def stop(self) -> None:
        """Drain (at most ``DRAIN_CAP_S``), stop the receiving thread (it commits what it has
        first), close the socket."""
        self.drain()
        self._stopping.set()
        self._thread.join(timeout=DRAIN_CAP_S)
        if self._thread.is_alive():  # a stuck commit: closing under it could crash the thread
            return
        self._socket.close()
        self._context.term()
