"""Rank side: context parallel: attention over a sequence split across ranks (ring attention).

Each rank keeps only its slice of the sequence for the whole model: its
activations are ``1/world`` of a full sequence, so sequences that fit no
single device fit the group. Everything but attention is per-token and needs
no communication. Attention needs every key and value: the ranks pass their
K/V blocks around a ring (``dist.batch_isend_irecv``), and each rank folds
each arriving block into its running softmax (the log-sum-exp merge of
flash attention), while the next block is already in flight. Backward sends
K/V around once more, with their gradients travelling along and arriving
home at the end. Per layer that is ``2 (world - 1)`` K/V blocks sent by each
rank in forward and about twice that in backward, overlapped with compute.

With a causal mask, contiguous slices do unequal work (the last rank attends
to everything, the first only to itself); ``load_balance=True`` gives rank
``r`` chunks ``r`` and ``2 world - 1 - r`` of ``2 world`` (head and tail,
torch's ``_HeadTailLoadBalancer``), so every rank does the same work.

torch has this as ``torch.distributed.tensor.experimental.context_parallel``
for CUDA's flash/efficient/cuDNN attention kernels; on CPU it raises
``NotImplementedError`` (``aten._scaled_dot_product_flash_attention_for_cpu``
has no sharding strategy). :func:`context_parallel` uses torch's where its
buffers are on CUDA (``backend="auto"``) and this module's ring everywhere
else, with the same sharding, so the code around it does not change. On CUDA,
"auto" also takes the ring when a rank's chunk of the sequence is not a multiple of
32 tokens: CUDA's memory-efficient attention (float32, or shapes flash attention
does not take) pads its log-sum-exp to a multiple of 32, and torch's merge of the
ring's blocks assumes it is as long as the chunk (a size mismatch from the second
block on; :func:`torch_path_fits`).

Example (on every rank)::

    from nbdist.strategies.parallel.context_parallel import context_parallel
    with context_parallel(group=None, buffers=[x, y, pos], seq_dims=[1, 1, 1]):
        loss = loss_fn(model(x, pos), y)          # x, y, pos: this rank's slices now;
        loss.backward()                            # SDPA inside the model is ring attention
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = [
    "context_parallel",
    "ring_attention",
    "ring_sdpa",
    "sequence_indices",
    "shard_sequence",
    "torch_path_fits",
    "unshard_sequence",
]


def _group_info(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "context parallel needs a torch.distributed process group: call it on the ranks "
            "(in a %%on_all_ranks cell after %dist_start)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def sequence_indices(
    seq_len: int, rank: int, world: int, *, load_balance: bool, device=None
) -> torch.Tensor:
    """Positions (in the full sequence) of the tokens that ``rank`` of ``world`` holds.

    Contiguous: ``rank``'s ``seq_len / world`` consecutive tokens. Load
    balanced: chunks ``rank`` and ``2 world - 1 - rank`` of ``2 world``.
    """
    chunks = 2 * world if load_balance else world
    if seq_len % chunks:
        raise ValueError(
            f"context parallel cuts the sequence into {chunks} equal chunks "
            f"({world} ranks{', two chunks each for load_balance' if load_balance else ''}): "
            f"sequence length {seq_len} is not divisible by {chunks}; pad it to "
            f"{-(-seq_len // chunks) * chunks}"
        )
    size = seq_len // chunks
    starts = [rank, 2 * world - 1 - rank] if load_balance else [rank]
    return torch.cat([torch.arange(s * size, (s + 1) * size, device=device) for s in starts])


def _check_dim(x, dim, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{what} has shape {tuple(x.shape)}: its sequence dim {dim!r} is none of its "
            f"dimensions (give 0..{x.dim() - 1}, e.g. 1 for (batch, seq, ...))"
        )


def _check_buffers(buffers, seq_dims) -> None:
    """Lists of tensors and of their sequence dims, one each, before any buffer is touched."""
    if not isinstance(buffers, (list, tuple)):
        raise TypeError(
            f"context_parallel: buffers= takes a list of tensors, got "
            f"{type(buffers).__name__}: write buffers=[x] (and seq_dims=[1])"
        )
    if not isinstance(seq_dims, (list, tuple)):
        raise TypeError(
            f"context_parallel: seq_dims= takes a list with one dim per buffer, got "
            f"{seq_dims!r}: write seq_dims=[{seq_dims!r}]"
        )
    if len(buffers) != len(seq_dims) or not buffers:
        raise ValueError(
            f"give one sequence dim per buffer: {len(buffers)} buffers, {len(seq_dims)} seq_dims"
        )
    for i, (b, dim) in enumerate(zip(buffers, seq_dims)):
        _check_dim(b, dim, f"context_parallel: buffer {i}")


def shard_sequence(x: torch.Tensor, dim: int, *, group=None, load_balance: bool = False):
    """This rank's slice of ``x`` along ``dim`` (a view-free copy; differentiable)."""
    _check_dim(x, dim, "shard_sequence: x")
    rank, world = _group_info(group)
    idx = sequence_indices(x.shape[dim], rank, world, load_balance=load_balance, device=x.device)
    return x.index_select(dim, idx)


def unshard_sequence(x: torch.Tensor, dim: int, *, group=None, load_balance: bool = False):
    """The full tensor from every rank's slice along ``dim`` (all-gather; not differentiable)."""
    _check_dim(x, dim, "unshard_sequence: x")
    rank, world = _group_info(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    full_len = x.shape[dim] * world
    order = torch.cat(
        [sequence_indices(full_len, r, world, load_balance=load_balance) for r in range(world)]
    )
    out = torch.empty_like(torch.cat(parts, dim))
    out.index_copy_(dim, order.to(x.device), torch.cat(parts, dim))
    return out


def _exchange(tensors, group, send_to: int, recv_from: int):
    """Start sending ``tensors`` to ``send_to`` and receiving as many from ``recv_from``."""
    # gloo sends contiguous memory only (k and v are often transposed views).
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, recv_from, group) for r in received]
    return dist.batch_isend_irecv(ops), received


def _block_mask(q_pos, k_pos, causal: bool):
    """``None`` (attend to all), ``False`` (nothing: skip the block), or a boolean mask."""
    if not causal:
        return None
    if int(q_pos.max()) < int(k_pos.min()):
        return False
    if int(q_pos.min()) >= int(k_pos.max()):
        return None
    return q_pos[:, None] >= k_pos[None, :]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, load_balance):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world)
        prv = dist.get_global_rank(group, (rank - 1) % world)
        t_local = q.shape[-2]
        pos = [
            sequence_indices(t_local * world, r, world, load_balance=load_balance, device=q.device)
            for r in range(world)
        ]
        qf = q.float()
        # Running softmax statistics in float32 whatever the input dtype: max, sum, output.
        m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        lsum = torch.zeros_like(m)
        acc = torch.zeros(q.shape[:-1] + (v.shape[-1],), device=q.device)
        kv = (k.contiguous(), v.contiguous())
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                # In flight while this block is computed.
                works, incoming = _exchange(kv, group, nxt, prv)
            mask = _block_mask(pos[rank], pos[src], causal)
            if mask is not False:
                s = (qf @ kv[0].float().transpose(-2, -1)) * scale
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                # The own block comes first and holds each token's own position: m is finite.
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new[..., None])
                corr = torch.exp(m - m_new)
                lsum = lsum * corr + p.sum(-1)
                acc = acc * corr[..., None] + p @ kv[1].float()
                m = m_new
            if step < world - 1:
                for w in works:
                    w.wait()
                kv = tuple(incoming)
        out = acc / lsum[..., None]
        lse = m + torch.log(lsum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.pos = group, causal, scale, pos
        ctx.ring = (rank, world, nxt, prv)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world, nxt, prv = ctx.ring
        group, scale, pos = ctx.group, ctx.scale, ctx.pos
        qf, do = q.float(), grad_out.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kv = (k.contiguous(), v.contiguous())
        dkv = tuple(torch.zeros(t.shape, device=t.device) for t in (k, v))  # float32
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                works, incoming = _exchange(kv, group, nxt, prv)
            mask = _block_mask(pos[rank], pos[src], ctx.causal)
            dk, dv = dkv
            if mask is not False:
                kf, vf = kv[0].float(), kv[1].float()
                s = (qf @ kf.transpose(-2, -1)) * scale
                p = torch.exp(s - lse[..., None])
                if mask is not None:
                    p = p.masked_fill(~mask, 0.0)
                dv = dv + p.transpose(-2, -1) @ do
                ds = p * (do @ vf.transpose(-2, -1) - delta)
                dq = dq + (ds @ kf) * scale
                dk = dk + (ds.transpose(-2, -1) @ qf) * scale
            # The K/V gradients travel with their block; after a full turn they are home.
            # A ring of one is already home (and gloo has no pair to send to itself on).
            if world == 1:
                dkv = (dk, dv)
            else:
                dworks, dkv = _exchange((dk, dv), group, nxt, prv)
                for w in dworks:
                    w.wait()
            if step < world - 1:
                for w in works:
                    w.wait()
                kv = tuple(incoming)
        dk, dv = dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    scale: float | None = None,
    load_balance: bool = False,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys and values of every rank in ``group``.

    ``q``, ``k``, ``v``: ``(batch, heads, local_seq, head_dim)``, this rank's
    slice of the sequence as :func:`shard_sequence` cut it (with the same
    ``load_balance``). Equals ``scaled_dot_product_attention`` on the full
    sequence, sliced the same way; differentiable. ``group`` defaults to all
    ranks. Softmax statistics are kept in float32.
    """
    from nbdist.engine.backend_support import require

    require("ring attention (ring_attention)", ("send/recv",))
    _group_info(group)
    if q.dim() != 4 or k.shape != q.shape[:-1] + (k.shape[-1],) or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"ring_attention takes q, k, v as (batch, heads, local_seq, head_dim) with the same "
            f"batch, heads and length; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = group if group is not None else dist.group.WORLD
    return _RingAttention.apply(q, k, v, group, causal, scale, load_balance)


class ring_sdpa(TorchFunctionMode):  # noqa: N801 - used as a context manager
    """Inside the block, ``F.scaled_dot_product_attention`` is :func:`ring_attention` over ``group``.

    The model's own attention code stays as it is: each call gets this
    rank's sequence slice and returns its slice of the output. Arguments
    ring attention cannot honour (``attn_mask``, ``dropout_p > 0``,
    ``enable_gqa``) raise ``ValueError`` rather than compute something else.
    """

    def __init__(self, *, group=None, load_balance: bool = False) -> None:
        """Route SDPA to ring attention over ``group`` (all ranks by default)."""
        super().__init__()
        self.group, self.load_balance = group, load_balance

    def __torch_function__(self, func, types, args=(), kwargs=None):
        """Swap SDPA for ring attention; every other function runs as usual."""
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
        call = dict(zip(names, args), **kwargs)
        if (
            call.get("attn_mask") is not None
            or call.get("dropout_p", 0.0)
            or call.get("enable_gqa")
        ):
            raise ValueError(
                "context parallel (ring_sdpa) supports scaled_dot_product_attention with "
                "is_causal and scale only: drop attn_mask, dropout_p and enable_gqa (use "
                "is_causal=True for a causal mask)"
            )
        return ring_attention(
            call["query"],
            call["key"],
            call["value"],
            group=self.group,
            causal=bool(call.get("is_causal", False)),
            scale=call.get("scale"),
            load_balance=self.load_balance,
        )


LSE_ALIGN = 32  # CUDA memory-efficient attention: log-sum-exp length rounded up to this


def torch_path_fits(seq_len: int, world: int, load_balance: bool) -> bool:
    """Whether torch's context parallel can merge the blocks of a ``seq_len`` sequence
    split over ``world`` ranks on CUDA, whichever attention kernel SDPA picks there.

    torch merges each arriving block's output with its log-sum-exp, which CUDA's
    memory-efficient kernel returns padded to a multiple of :data:`LSE_ALIGN`; the
    merge holds when every query block it attends with is that long already: the
    rank's chunk, or with ``load_balance`` each of its two halves. One rank merges
    nothing.
    """
    if world == 1:
        return True
    chunk = seq_len // (2 * world if load_balance else world)
    return chunk > 0 and chunk % LSE_ALIGN == 0


@contextmanager
def context_parallel(
    *,
    buffers: list[torch.Tensor],
    seq_dims: list[int],
    group=None,
    mesh=None,
    load_balance: bool = True,
    backend: str = "auto",
) -> Iterator[None]:
    """Shard ``buffers`` in place on their sequence dims; SDPA inside the block attends over all ranks.

    As torch's ``context_parallel``: each buffer (inputs, labels, position
    ids: not parameters) holds this rank's slice inside the block and its
    full value again after it. ``group`` (or a 1-D ``mesh``) is the
    context-parallel group, all ranks by default. ``backend``: ``"ring"``
    (this module, any device), ``"torch"`` (torch's, CUDA only), ``"auto"``
    (torch's when the buffers are on CUDA and each rank's chunk is a multiple of
    32 tokens, :func:`torch_path_fits`; else the ring).
    """
    if backend not in ("auto", "ring", "torch"):
        raise ValueError(f"backend must be 'auto', 'ring' or 'torch', got {backend!r}")
    _check_buffers(buffers, seq_dims)
    owners: dict[int, int] = {}
    for i, b in enumerate(buffers):
        # Buffers are resized in place: two that share memory (x and y cut from one token
        # tensor) would overwrite each other, and a strided view would land elsewhere.
        first = owners.setdefault(b.untyped_storage().data_ptr(), i)
        if first != i or not b.is_contiguous():
            raise ValueError(
                f"context_parallel resizes its buffers in place, but buffer {i} (shape "
                f"{tuple(b.shape)}) "
                + (f"shares memory with buffer {first}" if first != i else "is a strided view")
                + ": pass tensors with their own memory, e.g. x.clone()"
            )
    if mesh is not None:
        group = mesh.get_group()
    on_cuda = buffers[0].device.type == "cuda"
    _, world = _group_info(group)
    fits = torch_path_fits(buffers[0].shape[seq_dims[0]], world, load_balance)
    if backend == "torch" or (backend == "auto" and on_cuda and fits):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.experimental import context_parallel as torch_cp
        from torch.distributed.tensor.experimental._attention import _cp_options

        if mesh is None:
            mesh = DeviceMesh.from_group(group or dist.group.WORLD, buffers[0].device.type)
        saved, _cp_options.enable_load_balance = _cp_options.enable_load_balance, load_balance
        try:
            with torch_cp(mesh, buffers=buffers, buffer_seq_dims=seq_dims):
                yield
        finally:
            _cp_options.enable_load_balance = saved
        return
    for i, (b, dim) in enumerate(zip(buffers, seq_dims)):
        # Every buffer is checked before the first is resized: none is left cut alone.
        try:
            sequence_indices(b.shape[dim], 0, world, load_balance=load_balance)
        except ValueError as exc:
            raise ValueError(f"buffer {i} (shape {tuple(b.shape)}): {exc}") from None
    originals = [b.clone() for b in buffers]
    for b, dim in zip(buffers, seq_dims):
        local = shard_sequence(b, dim, group=group, load_balance=load_balance)
        b.resize_(local.shape)
        b.copy_(local)
    try:
        with ring_sdpa(group=group, load_balance=load_balance):
            yield
    finally:
        for b, original in zip(buffers, originals):
            b.resize_(original.shape)
            b.copy_(original)
