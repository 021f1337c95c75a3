"""Rank side: sparse attention: each query attends to a pattern of keys, not to all of them.

Dense attention costs ``seq²`` in time and (without a fused kernel) memory.
A sliding window (each token sees the ``window`` tokens before it), a few
global tokens that see and are seen by everything (Longformer, BigBird), or a
block-sparse layout cut that to about ``seq × (window + globals)``. The pattern
is a *mask_mod* ``(b, h, q_idx, kv_idx) -> bool``, as FlexAttention
(``torch.nn.attention.flex_attention``) defines it; ``block_mask`` turns it
into a ``BlockMask`` listing, per block of queries, which key blocks hold any
allowed pair: those are all that is computed.

:func:`sparse_attention` runs it four ways:

- ``"flex"``: ``torch.compile(flex_attention)``, a fused kernel that skips the
  empty blocks. On CPU (torch 2.13) it runs forward only
  (``NotImplementedError: FlexAttention does not support backward on CPU``),
  and its first call compiles for many seconds. On CUDA the kernel's tiles must
  divide the mask's blocks, which the tiles TorchInductor picks need not (64 × 64
  for float32 with a head dimension of 16 on an H100/H200, against blocks of 32:
  "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"); where a block
  is not a multiple of 128 the forward's tiles are set to divide it
  (:func:`flex_kernel_options`).
- ``"flex_eager"``: ``flex_attention`` uncompiled: it materialises the whole
  score matrix (and warns); for checking masks. Forward only on CPU too.
- ``"blocks"``: this module, in plain torch ops: per query block, gather the
  key/value blocks the ``BlockMask`` lists and run SDPA on them. Work and memory
  follow the mask's density; differentiable on any device.
- ``"dense"``: ``scaled_dot_product_attention`` with the full boolean mask:
  the reference, ``seq²`` everything.

``"auto"`` takes ``"flex"`` on CUDA and ``"blocks"`` elsewhere.

Example (on every rank)::

    from nbdist.strategies.training.sparse_attention import block_mask, sliding_window, sparse_attention
    mask = block_mask(sliding_window(64, n_global=4), seq_len=1024, block_size=64)
    out = sparse_attention(q, k, v, mask)     # q, k, v: (batch, heads, seq, head_dim)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "BACKENDS",
    "block_mask",
    "block_sparse",
    "causal",
    "computed_fraction",
    "dense_mask",
    "flex_kernel_options",
    "sliding_window",
    "sparse_attention",
]

BACKENDS = ("auto", "flex", "flex_eager", "blocks", "dense")
_compiled_flex = None
# The largest tile TorchInductor's FlexAttention forward configurations use (torch 2.13).
_MAX_TILE = 128


def flex_kernel_options(q_len: int, q_block: int, kv_block: int) -> dict | None:
    """Forward tile sizes for compiled FlexAttention on CUDA that divide the mask's blocks.

    None where the defaults work: blocks that are multiples of 128 (every tile
    TorchInductor picks divides them), or fewer than 128 queries (its decoding
    kernel, which picks its own tiles). Else the largest tiles up to 64 that divide
    the blocks: ``{"fwd_BLOCK_M": ..., "fwd_BLOCK_N": ...}``. The backward's
    configurations are filtered by the same rule inside TorchInductor.
    """
    if q_len < _MAX_TILE or (q_block % _MAX_TILE == 0 and kv_block % _MAX_TILE == 0):
        return None
    return {"fwd_BLOCK_M": math.gcd(q_block, 64), "fwd_BLOCK_N": math.gcd(kv_block, 64)}


def causal():
    """The mask_mod of causal attention: a query sees itself and earlier keys."""

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return mask_mod


def sliding_window(window: int, *, n_global: int = 0, is_causal: bool = True):
    """Each query sees the ``window`` keys up to itself (``is_causal``) or within ``window`` either side.

    The first ``n_global`` tokens are global: every query sees them, and they
    see every key (only earlier ones when ``is_causal``).
    """
    from nbdist.strategies.arguments import require_numbers

    require_numbers("sliding_window", window=window, n_global=n_global)
    if window < 1 or n_global < 0 or window != int(window) or n_global != int(n_global):
        raise ValueError(
            f"sliding_window needs whole numbers window >= 1 and n_global >= 0, got window={window}, "
            f"n_global={n_global}"
        )

    def mask_mod(b, h, q_idx, kv_idx):
        near = (q_idx - kv_idx).abs() < window
        if is_causal:
            near = near & (q_idx >= kv_idx)
        glob = (kv_idx < n_global) | (q_idx < n_global)
        if is_causal:
            glob = glob & (q_idx >= kv_idx)
        return near | glob

    return mask_mod


def block_sparse(layout: torch.Tensor, block_size: int):
    """A mask_mod from a boolean ``layout[q_block, kv_block]`` of ``block_size``-token blocks."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(
            f"block_sparse: block_size must be a whole number >= 1, got {block_size!r}"
        )
    layout = torch.as_tensor(layout, dtype=torch.bool)
    if layout.dim() != 2:
        raise ValueError(
            f"layout must be 2-D (query blocks, key blocks), got {tuple(layout.shape)}"
        )

    rows, cols = layout.shape

    def mask_mod(b, h, q_idx, kv_idx):
        table = layout.to(q_idx.device)
        # Padding past the last block (the "blocks" backend pads to whole blocks) is clamped.
        return table[
            (q_idx // block_size).clamp_max(rows - 1), (kv_idx // block_size).clamp_max(cols - 1)
        ]

    # What block_mask checks the sequence against: positions past the layout would be
    # clamped onto its last row and column.
    mask_mod.layout_blocks = (rows, cols, block_size)
    return mask_mod


def block_mask(
    mask_mod, seq_len: int, *, kv_len: int | None = None, block_size: int = 128, device="cpu"
):
    """The ``BlockMask`` of ``mask_mod`` over ``seq_len`` queries and ``kv_len`` keys (one per batch and head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if block_size < 1 or seq_len < 1:
        raise ValueError(f"block_size and seq_len must be >= 1, got {block_size}, {seq_len}")
    kv_len = seq_len if kv_len is None else kv_len
    layout = getattr(mask_mod, "layout_blocks", None)
    if layout is not None:
        rows, cols, size = layout
        need = (-(-seq_len // size), -(-kv_len // size))
        # A layout for longer sequences serves shorter ones by its top-left blocks; one too
        # small would clamp the positions past it onto its last row and column.
        if need[0] > rows or need[1] > cols:
            raise ValueError(
                f"the block_sparse layout is {rows} x {cols} blocks of {size} tokens, but "
                f"{seq_len} queries x {kv_len} keys need {need[0]} x {need[1]} blocks: give a "
                f"layout of at least {need[0]} x {need[1]} (one entry per {size}-token block)"
            )
    return create_block_mask(
        mask_mod, None, None, seq_len, kv_len, device=device, BLOCK_SIZE=block_size
    )


def dense_mask(mask, seq_len: int, kv_len: int | None = None, *, device="cpu") -> torch.Tensor:
    """The boolean ``(seq_len, kv_len)`` matrix of a mask_mod or ``BlockMask`` (True: attend)."""
    from torch.nn.attention.flex_attention import BlockMask, create_mask

    mask_mod = mask.mask_mod if isinstance(mask, BlockMask) else mask
    kv_len = seq_len if kv_len is None else kv_len
    return create_mask(mask_mod, 1, 1, seq_len, kv_len, device=device)[0, 0]


def _blocks(q, k, v, mask, scale):
    """Attention over the key blocks ``mask`` lists for each query block, in plain torch ops."""
    B, H, T, D = q.shape
    S = k.shape[-2]
    qbs, kbs = mask.BLOCK_SIZE
    nq, nk = -(-T // qbs), -(-S // kbs)
    # The listed key blocks per query block: partial ones (mask_mod decides per pair)
    # and full ones (all pairs allowed); padding slots are marked invalid.
    parts = [(mask.kv_num_blocks, mask.kv_indices)]
    if mask.full_kv_num_blocks is not None:
        parts.append((mask.full_kv_num_blocks, mask.full_kv_indices))
    idx, valid = [], []
    for num, ind in parts:
        ind = ind[..., :nq, :]
        idx.append(ind.long())
        valid.append(torch.arange(ind.shape[-1], device=q.device) < num[..., :nq, None])
    idx, valid = torch.cat(idx, -1), torch.cat(valid, -1)
    width = max(int(valid.sum(-1).max()), 1)
    order = valid.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :width]
    # Kept at the mask's own batch/head size (usually 1): broadcast, not copied.
    idx = idx.gather(-1, order).clamp_max(nk - 1)
    valid = valid.gather(-1, order)

    def pad(x, n, bs):
        return F.pad(x, (0, 0, 0, n * bs - x.shape[-2])).view(B, H, n, bs, x.shape[-1])

    qb = pad(q, nq, qbs)
    b_i = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h_i = torch.arange(H, device=q.device).view(1, H, 1, 1)
    # (B, H, nq, width * kbs, D): only the listed key blocks, gathered next to their queries.
    kb = pad(k, nk, kbs)[b_i, h_i, idx].flatten(3, 4)
    vb = pad(v, nk, kbs)[b_i, h_i, idx].flatten(3, 4)
    q_pos = torch.arange(nq, device=q.device)[:, None] * qbs + torch.arange(qbs, device=q.device)
    k_pos = (idx[..., None] * kbs + torch.arange(kbs, device=q.device)).flatten(-2)
    mb, mh = idx.shape[:2]
    allowed = mask.mask_mod(
        torch.arange(mb, device=q.device).view(mb, 1, 1, 1, 1),
        torch.arange(mh, device=q.device).view(1, mh, 1, 1, 1),
        q_pos[None, None, :, :, None],
        k_pos[..., None, :],
    )
    allowed = allowed & valid.repeat_interleave(kbs, -1)[..., None, :] & (k_pos < S)[..., None, :]
    # SDPA over the gathered blocks (extra batch dims are fine): its CPU kernel works in
    # tiles, and rows with nothing allowed come out 0, as FlexAttention's do.
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed, scale=scale)
    return out.flatten(2, 3)[:, :, :T]


def sparse_attention(q, k, v, mask, *, backend: str = "auto", scale: float | None = None):
    """Attention of ``q`` over ``k``/``v`` (``(batch, heads, seq, head_dim)``) where ``mask`` allows.

    ``mask`` is a ``BlockMask`` (:func:`block_mask`) built for these lengths.
    ``backend``: ``"flex"``, ``"blocks"``, ``"dense"`` or ``"auto"`` (see the
    module docstring). All compute the same numbers up to float rounding.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(mask, BlockMask):
        raise TypeError(
            f"mask must be a BlockMask (make one with block_mask(mask_mod, seq_len)), "
            f"got {type(mask).__name__}"
        )
    T, S = q.shape[-2], k.shape[-2]
    if tuple(mask.seq_lengths) != (T, S):
        raise ValueError(
            f"the BlockMask was built for {tuple(mask.seq_lengths)} (queries, keys) but q has "
            f"{T} and k {S}: build it with block_mask(mask_mod, {T}, kv_len={S})"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "blocks"
    if backend in ("flex", "flex_eager"):
        if q.device.type == "cpu" and grad:
            raise ValueError(
                "FlexAttention has no backward on CPU (torch says NotImplementedError): use "
                "backend='blocks' (or 'auto') to train on CPU, or run under torch.no_grad()"
            )
        if not grad:
            # torch refuses inputs that require grad on CPU even under no_grad.
            q, k, v = q.detach(), k.detach(), v.detach()
        if backend == "flex_eager":
            return flex_attention(q, k, v, block_mask=mask, scale=scale)
        global _compiled_flex
        if _compiled_flex is None:
            # Compiled once per process; each new shape may compile again (seconds on CPU).
            _compiled_flex = torch.compile(flex_attention)
        options = None
        if q.device.type == "cuda":
            options = flex_kernel_options(T, *mask.BLOCK_SIZE)
        return _compiled_flex(q, k, v, block_mask=mask, scale=scale, kernel_options=options)
    if backend == "dense":
        allowed = dense_mask(mask, T, S, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    return _blocks(q, k, v, mask, scale)


def computed_fraction(mask) -> float:
    """The share of (query block, key block) pairs a ``BlockMask`` computes: 1.0 is dense."""
    nq, nk = (-(-n // b) for n, b in zip(mask.seq_lengths, mask.BLOCK_SIZE))
    listed = mask.kv_num_blocks[..., :nq].sum()
    if mask.full_kv_num_blocks is not None:
        listed = listed + mask.full_kv_num_blocks[..., :nq].sum()
    return listed.item() / (mask.kv_num_blocks[..., 0].numel() * nq * nk)
