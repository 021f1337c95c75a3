"""Rank side: which collective each rank entered last, the clue that explains a hang.

nbdist wraps the collective functions of ``torch.distributed`` on every rank
(``dist.all_reduce``, ``dist.barrier``, ...) so that each call is counted and
remembered: its name, its sequence number in this group, whether it
returned, whom it waits for (its group, or a point-to-point call's peer),
its first tensor's dtype and shape (never the tensor), and, for an async call,
its works (weakly: whether a wait on them can still be waiting). When ranks
hang, comparing these records says who is waiting for whom ("rank 1 never
entered all_reduce #118"), and lets the kernel's cell guard release ranks whose
collective can no longer end (:mod:`nbdist.driver.faults`); where the ranks made
the same call with different tensors, it names them ("with float32 [4]").

Only calls made through the ``torch.distributed`` namespace are counted (what
user code and most libraries call); torch's own internal calls and DDP's
gradient buckets (C++) are not. The wall time of each outermost call (and, for
CUDA tensors, a pair of CUDA events around it) goes to the step breakdown's
``comm_s`` (:mod:`nbdist.metrics.steptime`, which says what that measures). ``isend`` and
``irecv`` are wrapped in ``distributed_c10d`` too: torch compares a ``P2POp``'s op with
that module's own by identity, and torch's pipeline schedules post a batch of sends (or of
receives) through them one by one, then wait on their works. Inside another wrapped call
(``batch_isend_irecv``'s ops, ``send``'s own ``isend``) they are not counted again.
Bookkeeping costs one small object per call, about a microsecond next to collectives that
take tens of microseconds at least.

Example (on a rank, where nbdist installed it already)::

    from nbdist.engine import collectives
    dist.all_reduce(t)
    collectives.last()   # {'op': 'all_reduce', 'seq': 1, 'inside': False, ...,
                         #  'tensor': 'float32 [4]'}
"""

from __future__ import annotations

import functools
import time
import weakref

from nbdist.metrics import steptime

__all__ = ["TRACKED_OPS", "cell_started", "install", "last", "open_work_since", "reset"]

TRACKED_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",  # torch 2.13's name for all_gather_into_tensor
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",  # and for reduce_scatter_tensor
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class _Record:
    __slots__ = (
        "op",
        "seq",
        "entered",
        "exited",
        "raised",
        "group",
        "peer",
        "group_peer",
        "works",
        "shape",
        "dtype",
    )

    def __init__(self, op: str, seq: int, entered: float) -> None:
        self.op = op
        self.seq = seq
        self.entered = entered
        self.exited: float | None = None
        self.raised = False
        # Whom the call waits for, read when asked (_ranks): its group (None: the default
        # one) and, for point-to-point, its peer (a global rank, or batch_isend_irecv's) or
        # the peer as a rank of its group. The tensors are not kept.
        self.group = None
        self.peer: int | tuple[int, ...] | None = None
        self.group_peer: int | None = None
        # The works an async call returned (``async_op=True``, ``batch_isend_irecv``), held
        # weakly: a wait on them is in C++, where a rank a release cannot free stays
        # (held_collective.py). gloo's flight recorder does not record point-to-point calls.
        self.works: list | None = None
        # The shape and dtype of its first tensor (not the tensor): calls that paired across
        # the ranks with different tensors (gloo pairs by order, not by size) are named by
        # what differs. None where the call has none (barrier, an object list).
        self.shape = None
        self.dtype = None


# Where each op takes its peer and its group's peer, by name (their positions: _positions).
_PEER_ARGS = {
    "send": ("dst", "group_dst"),
    "recv": ("src", "group_src"),
    "isend": ("dst", "group_dst"),
    "irecv": ("src", "group_src"),
}
# Compared by identity with distributed_c10d's own (P2POp's check): wrapped there too.
_CHECKED_BY_IDENTITY = ("isend", "irecv")


def _positions(op: str, fn) -> tuple[int | None, int | None, int | None, str | None]:
    """Where ``fn`` takes its group, peer and group peer, by position, and the name of its
    first parameter, which takes the tensor (or list) recorded: ``"tensor"``,
    ``"output_tensor"``; None for the barriers (their first is the group) and for a function
    known only as ``*args``."""
    import inspect

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: keywords only
        names = []
    peer, group_peer = _PEER_ARGS.get(op, (None, None))

    def at(name):
        return names.index(name) if name in names else None

    first = names[0] if names and names[0] not in ("group", "args") else None
    return at("group"), at(peer), at(group_peer), first


def _arg(args: tuple, kwargs: dict, name: str | None, index: int | None):
    if name is not None and name in kwargs:
        return kwargs[name]
    return args[index] if index is not None and index < len(args) else None


_seq = 0
_last: _Record | None = None
_depth = 0  # > 0 inside a wrapped call: a collective made by another is not timed twice
_cell_began: float | None = None  # when this rank's current (or last) cell began
# Every work a call returned that may be unfinished, weakly (a pipeline step posts its sends
# and receives, then waits on them): one an interrupt left behind would take the data of a
# later call between the same ranks. Pruned of finished ones past _prune_at works.
_unfinished: list = []
_prune_at = 256


def _tracked(op: str, fn):
    group_at, peer_at, group_peer_at, first_name = _positions(op, fn)
    peer_name, group_peer_name = _PEER_ARGS.get(op, (None, None))
    batch = op == "batch_isend_irecv"
    one_of_many = op in _CHECKED_BY_IDENTITY

    @functools.wraps(fn)
    def tracked(*args, **kwargs):
        global _seq, _last, _depth
        if one_of_many and _depth:
            # One op of a batch_isend_irecv, or send's own isend: the outer call is the record.
            return fn(*args, **kwargs)
        _seq += 1
        record = _last = _Record(op, _seq, time.monotonic())
        # Inline, not a helper call: this runs on every collective.
        if "group" in kwargs:
            record.group = kwargs["group"]
        elif group_at is not None and group_at < len(args):
            record.group = args[group_at]
        if peer_name is not None:
            record.peer = _arg(args, kwargs, peer_name, peer_at)
            record.group_peer = _arg(args, kwargs, group_peer_name, group_peer_at)
        elif batch and args:
            record.peer = tuple(getattr(p, "peer", None) for p in args[0])
        outer = _depth == 0
        end_event = None
        if outer:
            # By position, or by name (``dist.all_reduce(tensor=t)``); None for barrier.
            first = args[0] if args else kwargs.get(first_name) if kwargs else None
            if first is not None:
                if isinstance(first, (list, tuple)) and first:
                    first = first[0]
                end_event = steptime.cuda_comm_events(first)
                try:  # two attribute reads; the tensor itself is not kept
                    record.shape = first.shape
                    record.dtype = first.dtype
                except Exception:  # not a tensor (batch_isend_irecv's ops, an object's item)
                    pass
        _depth += 1
        try:
            result = fn(*args, **kwargs)
            if result is not None:  # a synchronous collective returns None
                record.works = _weakly(result)
                if record.works:
                    _unfinished.extend(record.works)
                    if len(_unfinished) > _prune_at:
                        _prune_unfinished()
            return result
        except BaseException:
            record.raised = True  # e.g. a peer died or the group was released
            raise
        finally:
            _depth -= 1
            # For async_op=True this is when the call returned, not when the
            # work completed: the wait is where such a rank would block.
            record.exited = time.monotonic()
            if end_event is not None:
                end_event.record()  # NCCL returns once queued: the device time counts, not this
            elif outer:
                steptime.collective_done(record.exited - record.entered)

    tracked.nbdist_original = fn
    return tracked


def _weakly(result) -> list | None:
    """Weak references to the works in ``result`` (a Work, or a list of them), or None."""
    found = result if isinstance(result, list) else [result]
    try:
        return [weakref.ref(w) for w in found if hasattr(w, "is_completed")] or None
    except TypeError:  # a work without weak references: not kept (nor kept alive)
        return None


def open_work_since(moment: float) -> str | None:
    """``"batch_isend_irecv #4"``: the last call, entered before ``moment``, whose works are unfinished.

    ``moment`` is on ``time.monotonic()``'s clock. None where the last call returned no
    works, entered later, or every work it returned finished (or was dropped).
    """
    record = _last
    if record is None or record.entered > moment or not _has_open_work(record):
        return None
    return f"{record.op} #{record.seq}"


def _prune_unfinished() -> None:
    """Drop the finished (or dropped) works from ``_unfinished`` (on the main thread only:
    the control thread's :func:`last` reads the list, and a list it rebound would lose the
    works the main thread adds meanwhile)."""
    global _unfinished, _prune_at
    _unfinished = [ref for ref in _unfinished if _is_open(ref())]
    # A loop that keeps many works open (a long pipeline) is pruned as rarely per work.
    _prune_at = max(256, 2 * len(_unfinished))


def _is_open(work) -> bool:
    try:
        return work is not None and not work.is_completed()
    except Exception:  # a work whose group was destroyed: not waited for
        return False


def _has_open_work(record: _Record) -> bool:
    """Whether a work ``record``'s call returned is still unfinished (its wait would block)."""
    return any(_is_open(ref()) for ref in record.works or ())


def install() -> None:
    """Wrap the collectives of ``torch.distributed`` (idempotent)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for op in TRACKED_OPS:
        fn = getattr(dist, op, None)
        if fn is None or hasattr(fn, "nbdist_original"):
            continue
        wrapped = _tracked(op, fn)
        setattr(dist, op, wrapped)
        if op in _CHECKED_BY_IDENTITY:
            # P2POp(dist.isend, ...) must pass torch's check against c10d's own isend.
            setattr(c10d, op, wrapped)


def reset() -> None:
    """Start counting from zero (a new group: every rank resets together)."""
    global _seq, _last
    _seq, _last = 0, None
    _unfinished.clear()  # the old group's: nothing of the new one pairs with them


def cell_started() -> None:
    """Note that a cell begins on this rank (IPython's ``pre_execute`` event).

    :func:`last` then says whether its collective belongs to this cell, on this
    rank's own clock: the kernel's clock, compared with ``seconds``, cannot tell a
    collective of the previous cell that ended a few milliseconds before this one
    was sent (the reply's way back to the kernel takes longer under load).
    """
    global _cell_began
    _cell_began = time.monotonic()


def last() -> dict | None:
    """The last collective this rank entered, or None if none since the group formed.

    ``inside`` is True while the call has not returned; ``seconds`` is how long
    it has been inside, or how long ago it returned; ``raised`` if it ended
    with an exception; ``this_cell`` if it was entered during the cell running
    now (or last); ``ranks``: the global ranks it waits for (its group's, or
    a point-to-point call's peers; None where they cannot be read); ``open_works``
    if it returned works (``batch_isend_irecv``, ``async_op=True``) not completed: a
    pipeline's rank waits on them in C++, outside the call; ``unfinished``: how many works
    of any call are (one an interrupt left would take a later call's data); ``tensor``: the
    dtype and shape of its first tensor (``"float32 [4]"``), None where it took none.
    """
    record = _last
    if record is None:
        return None
    now = time.monotonic()
    exited = record.exited
    return {
        "op": record.op,
        "seq": record.seq,
        "inside": exited is None,
        "raised": record.raised,
        "seconds": now - (record.entered if exited is None else exited),
        "this_cell": _cell_began is not None and record.entered >= _cell_began,
        "ranks": _ranks(record),
        "open_works": exited is not None and _has_open_work(record),
        "unfinished": sum(_is_open(ref()) for ref in list(_unfinished)),
        "tensor": _tensor_text(record),
    }


def _tensor_text(record: _Record) -> str | None:
    """``"float32 [4, 16]"``: the dtype and shape of ``record``'s first tensor, or None."""
    try:
        if record.shape is None or record.dtype is None:
            return None
        dtype = str(record.dtype).removeprefix("torch.")
        return f"{dtype} [{', '.join(str(int(n)) for n in record.shape)}]"
    except Exception:  # a shape that is not a sequence of whole numbers: not named
        return None


def _ranks(record: _Record) -> list[int] | None:
    """The global ranks ``record``'s call waits for, this rank left out."""
    import torch.distributed as dist

    try:
        group = record.group if record.group is not None else dist.group.WORLD
        if isinstance(record.peer, tuple):
            found = set(record.peer)
        elif record.op in _PEER_ARGS:
            if record.peer is None and record.group_peer is None:
                return None  # recv from any rank: waits for whoever sends
            found = {
                record.peer
                if record.peer is not None
                else dist.get_global_rank(group, record.group_peer)
            }
        else:
            found = set(dist.get_process_group_ranks(group))
        found.discard(dist.get_rank())
    except Exception:  # a group destroyed since, or no group at all: not known
        return None
    return None if None in found else sorted(found)
