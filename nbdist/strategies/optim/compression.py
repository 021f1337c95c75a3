"""Rank side: compressed gradient all-reduce for DDP (fp16, bf16, PowerSGD), with the bytes counted.

DDP all-reduces every gradient every step: 4 bytes per parameter per rank in
fp32. When the network, not the arithmetic, is the bottleneck (many ranks,
slow links, CPUs over Ethernet), sending fewer bytes buys time, at a price in
accuracy. DDP's communication hooks replace its all-reduce of each gradient
bucket; :func:`apply_comm_hook` installs one of torch's and counts the bytes
this rank hands to the all-reduce:

- ``"none"``: the plain fp32 all-reduce (``allreduce_hook``), the reference:
  4 bytes per parameter.
- ``"fp16"`` / ``"bf16"``: cast each bucket to 16 bits, all-reduce, cast back
  (``fp16_compress_hook``, ``bf16_compress_hook``): half the bytes, and every
  averaged gradient rounded to 11 (fp16) or 8 (bf16) significant bits; fp16
  also flushes values below 6e-8 to zero and overflows above 65504.
- ``"powersgd"``: PowerSGD (Vogels et al. 2019, ``powerSGD_hook``): each
  gradient matrix ``n x m`` is replaced by a rank-``r`` product ``P Q^T``, one
  power-iteration step per training step warm-started from the previous
  step's ``Q``, and only ``P`` and ``Q`` are all-reduced: ``(n + m) r``
  numbers instead of ``n m``. It is biased, so the part of the gradient it
  drops is kept on each rank (*error feedback*) and added to the next step's
  gradient. The first ``start_iter`` steps use the plain all-reduce (early
  gradients matter most, and DDP rebuilds its buckets after step 1). Vectors
  (biases) and matrices that would not shrink by ``min_compression_rate`` go
  uncompressed. Costs: two all-reduces per bucket instead of one, two small
  matmuls per matrix, and one gradient-sized error buffer per rank.

The counter (:class:`CommCounter`) holds the *payload*: the bytes of the tensors
this rank passes to ``all_reduce`` (what compression shrinks). How many bytes
cross a link depends on the algorithm: a ring all-reduce sends
``2 (world - 1) / world`` times the payload from each rank.

Example::

    from nbdist.strategies.optim.compression import apply_comm_hook
    model = DDP(net)
    sent = apply_comm_hook(model, "powersgd", matrix_rank=2, start_iter=10)
    for step in range(steps):
        ...
        loss.backward(); opt.step()
        nbdist.log(step=step, loss=loss, sent_per_step_mib=sent.take() / 2**20)
"""

from __future__ import annotations

import threading

from torch import nn

__all__ = ["COMPRESSIONS", "CommCounter", "apply_comm_hook", "dense_bytes"]

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")


class CommCounter:
    """Bytes this rank handed to collectives, in all and since the last :meth:`take`.

    ``total``: bytes sent as compressed; ``dense``: what the same tensors would
    have cost uncompressed in their own dtype, so ``dense / total`` is the
    compression ratio. Hooks may run on autograd's thread: updates take a lock.
    ``powersgd_state`` is torch's ``PowerSGDState`` when PowerSGD is installed.

    Example::

        sent = CommCounter()
        sent.add(2_000, dense=4_000)
        sent.take()      # 2000, and the next take() counts from here
    """

    def __init__(self) -> None:
        """A counter at zero."""
        self.total = 0
        self.dense = 0
        self.calls = 0
        self.powersgd_state = None
        self._taken = 0
        self._lock = threading.Lock()

    def add(self, sent: int, *, dense: int | None = None) -> None:
        """Count ``sent`` bytes (``dense``: their uncompressed size; default the same)."""
        with self._lock:
            self.total += int(sent)
            self.dense += int(sent if dense is None else dense)
            self.calls += 1

    def take(self) -> int:
        """Bytes sent since the previous call (call once per step: bytes per step)."""
        with self._lock:
            new, self._taken = self.total - self._taken, self.total
        return new

    @property
    def ratio(self) -> float:
        """Uncompressed over sent bytes so far (1.0 before anything was sent)."""
        return self.dense / self.total if self.total else 1.0

    def __repr__(self) -> str:
        """Totals and ratio, for a notebook's output."""
        return f"CommCounter(total={self.total}, dense={self.dense}, ratio={self.ratio:.2f})"


def dense_bytes(model: nn.Module) -> int:
    """Bytes of all gradients of ``model``: what one uncompressed all-reduce per step sends.

    Example::

        dense_bytes(nn.Linear(10, 4))   # (40 + 4) * 4 = 176
    """
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _bucket_bytes(bucket) -> int:
    buffer = bucket.buffer()
    return buffer.numel() * buffer.element_size()


def _counted_cast(inner, counter: CommCounter, itemsize: int):
    # The hook sends the bucket in ``itemsize`` bytes per element (fp32: 4, fp16/bf16: 2).
    def hook(state, bucket):
        buffer = bucket.buffer()
        counter.add(buffer.numel() * itemsize, dense=_bucket_bytes(bucket))
        return inner(state, bucket)

    return hook


def _counted_powersgd(inner, counter: CommCounter):
    def hook(state, bucket):
        # torch's hook adds to total_numel_after_compression (P and Q sizes, plus the
        # tensors it leaves uncompressed) synchronously, only once compression has
        # started; before that it all-reduces the whole bucket.
        before = state.total_numel_after_compression
        future = inner(state, bucket)
        numel = state.total_numel_after_compression - before
        buffer = bucket.buffer()
        if numel <= 0:
            numel = buffer.numel()
        counter.add(numel * buffer.element_size(), dense=_bucket_bytes(bucket))
        return future

    return hook


def _one_bucket_bytes(model) -> tuple[int, str]:
    """The most gradient bytes DDP keeps in one bucket once it rebuilds them after step 1, and
    how the user set that limit (for the error).

    The rebuilt buckets' limits are ``[first, cap, cap, ...]``: torch's default DDP (no
    ``bucket_cap_mb``) has a 1 MiB first bucket under its 25 MiB cap, so 1-25 MiB of
    gradients make two buckets although they are under ``bucket_cap_mb``.
    """
    import torch.distributed as dist

    cap = int(getattr(model, "bucket_bytes_cap", 0) or 0)
    per_bucket = [int(c) for c in getattr(model, "bucket_bytes_cap_list", None) or ()]
    # torch 2.13 keeps the first bucket's size in _bucket_config; older torch in this flag.
    config = getattr(model, "_bucket_config", None)
    first = getattr(config, "first_bucket_bytes_cap", None)
    if first is None:
        default = getattr(model, "bucket_bytes_cap_default", False)
        first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 2**20) if default else cap
    if per_bucket and min(per_bucket) < cap:
        return min(per_bucket), f"bucket_cap_mb_list's {min(per_bucket) / 2**20:g} MiB bucket"
    if 0 < first < cap:
        return first, f"DDP's first bucket of {first / 2**20:g} MiB (bucket_cap_mb unset)"
    return cap, f"bucket_cap_mb={cap / 2**20:g}"


def _one_bucket_on_gloo(model, group) -> None:
    """PowerSGD over gloo: DDP's gradients must fit one bucket, or a rank aborts (or the cell hangs).

    With two or more buckets, the buckets' PowerSGD all-reduces interleave in a
    different order on each rank and gloo fails ("Received data size doesn't match
    expected size"; reproduced with torch 2.13's own ``powerSGD_hook`` and no nbdist
    code). One bucket has one order. NCCL was not checked: the rule applies to gloo only.
    """
    import torch.distributed as dist

    pg = group if group is not None else getattr(model, "process_group", None)
    if dist.get_backend(pg) != "gloo":
        return
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    limit, limit_is = _one_bucket_bytes(model)
    if limit and grad_bytes > limit:
        need = -(-grad_bytes // 2**20) + 1
        raise ValueError(
            f"PowerSGD over gloo needs DDP's gradients in one bucket: this model's are "
            f"{grad_bytes / 2**20:.1f} MiB over {limit_is} (several buckets make gloo's "
            f"all-reduces interleave differently per rank and abort). Build "
            f"DistributedDataParallel(model, bucket_cap_mb={need}), or use 'fp16'/'bf16'"
        )


def apply_comm_hook(
    model: nn.Module,
    compression: str = "fp16",
    *,
    counter: CommCounter | None = None,
    matrix_rank: int = 1,
    start_iter: int = 10,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int = 0,
    group=None,
) -> CommCounter:
    """Replace DDP's gradient all-reduce of ``model`` by a compressed one, counting bytes.

    ``model``: a ``DistributedDataParallel`` that has not run a step with another
    hook. ``compression``: one of :data:`COMPRESSIONS`. PowerSGD's settings:
    ``matrix_rank`` (``r``, 1-4 is typical), ``start_iter`` (plain all-reduce
    steps first, at least 2 with error feedback or warm start),
    ``min_compression_rate``, ``error_feedback``, ``warm_start``, ``seed`` (the
    random start of ``Q``, the same on every rank). ``group``: the process group
    (default: DDP's). Returns the :class:`CommCounter` (``counter`` if given).
    PowerSGD over gloo needs the gradients in one DDP bucket (``bucket_cap_mb``
    given, at least their size: without it DDP's first bucket holds 1 MiB): a
    clear error says so, and which ``bucket_cap_mb`` to pass, before anything runs.

    Example::

        sent = apply_comm_hook(ddp_model, "bf16")
        loss.backward()                 # buckets cast to bf16, all-reduced, cast back
        print(sent.take(), "bytes this step")
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"apply_comm_hook needs a DistributedDataParallel model, got {type(model).__name__}: "
            "wrap it first, model = DistributedDataParallel(model)"
        )
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is not one of {COMPRESSIONS}")
    if compression == "powersgd":
        from nbdist.strategies.arguments import require_numbers, require_whole

        require_numbers("apply_comm_hook", min_compression_rate=min_compression_rate)
        # A rank of P Q^T and a step count: 2.5 would reach torch as a tensor shape.
        require_whole("apply_comm_hook", matrix_rank=matrix_rank, start_iter=start_iter)
        if matrix_rank < 1:
            raise ValueError(f"matrix_rank={matrix_rank}: the rank of P Q^T must be at least 1")
        if (error_feedback or warm_start) and start_iter < 2:
            raise ValueError(
                f"start_iter={start_iter}: PowerSGD with error feedback or warm start needs "
                "start_iter >= 2 (DDP rebuilds its buckets after step 1); pass start_iter=2 or more"
            )
        _one_bucket_on_gloo(model, group)
    counter = counter if counter is not None else CommCounter()
    if compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=matrix_rank,
            start_powerSGD_iter=start_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=error_feedback,
            warm_start=warm_start,
            random_seed=seed,
        )
        counter.powersgd_state = state
        model.register_comm_hook(state, _counted_powersgd(powerSGD_hook.powerSGD_hook, counter))
        return counter
    inner, itemsize = {
        "none": (default_hooks.allreduce_hook, None),
        "fp16": (default_hooks.fp16_compress_hook, 2),
        "bf16": (default_hooks.bf16_compress_hook, 2),
    }[compression]
    if itemsize is None:  # uncompressed: the gradients' own dtype
        itemsize = next(p.element_size() for p in model.parameters() if p.requires_grad)
    model.register_comm_hook(group, _counted_cast(inner, counter, itemsize))
    return counter
