"""Rank side: mixed precision: the autocast dtype and the gradient scaler that suit a device.

Autocast runs matrix multiplies and convolutions in a 16-bit type while weights,
optimizer state and reductions stay in float32: about half the activation memory and,
on GPUs with tensor cores, several times the matmul throughput.

- bfloat16 keeps float32's exponent range: no loss scaling needed. CPUs run it
  (autocast on CPU supports only bfloat16) and so do GPUs from Ampere on.
- float16 has more mantissa but a narrow range: small gradients underflow to zero, so
  the loss is multiplied by a large factor before ``backward()`` and the gradients
  divided again before the step (``torch.amp.GradScaler``), skipping steps whose
  gradients overflowed. Only on CUDA.

Example (on every rank)::

    from nbdist.strategies.training.amp import autocast, grad_scaler, pick_dtype
    dtype = pick_dtype(device)                 # bf16 on CPU and recent GPUs, else fp16
    scaler = grad_scaler(device, dtype)        # a no-op unless fp16 on CUDA
    with autocast(device, dtype):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""

from __future__ import annotations

import torch

__all__ = ["autocast", "grad_scaler", "pick_dtype"]

_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _device(device) -> torch.device:
    if device is None:
        from nbdist.engine.helpers import device as rank_device

        return rank_device()
    return torch.device(device)


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in (torch.bfloat16, torch.float16):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _NAMES:
        return _NAMES[dtype.lower()]
    raise ValueError(f"autocast dtype {dtype!r} is not supported: use 'bf16' or 'fp16'")


def pick_dtype(device=None, prefer: str | torch.dtype | None = None) -> torch.dtype:
    """The 16-bit type autocast should use on ``device`` (default: this rank's device).

    CPU: bfloat16 (the only type CPU autocast supports). CUDA: bfloat16 where the GPU
    supports it, else float16; ``prefer="fp16"`` asks for float16 on CUDA.

    >>> pick_dtype("cpu")
    torch.bfloat16
    """
    dev = _device(device)
    wanted = None if prefer is None else _dtype(prefer)
    if dev.type == "cuda":
        if wanted is not None:
            if wanted == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise ValueError(
                    f"bf16 is not supported on {torch.cuda.get_device_name(dev)}: "
                    "use prefer='fp16' (with grad_scaler)"
                )
            return wanted
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if wanted == torch.float16:
        raise ValueError(
            f"fp16 autocast is for CUDA devices, not {dev}: use bf16 on {dev.type} "
            "(pick_dtype(device) chooses it)"
        )
    return torch.bfloat16


def autocast(device=None, dtype: str | torch.dtype | None = None, *, enabled: bool = True):
    """``torch.autocast`` for ``device`` with :func:`pick_dtype`'s type unless ``dtype`` is given."""
    dev = _device(device)
    chosen = pick_dtype(dev) if dtype is None else pick_dtype(dev, prefer=dtype)
    return torch.autocast(device_type=dev.type, dtype=chosen, enabled=enabled)


def grad_scaler(device=None, dtype: str | torch.dtype | None = None) -> torch.amp.GradScaler:
    """A ``GradScaler`` that scales only where it is needed: float16 on CUDA.

    For bfloat16 (or on CPU) it is returned disabled, so the same
    ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` loop works
    unchanged with every dtype.
    """
    dev = _device(device)
    chosen = pick_dtype(dev) if dtype is None else pick_dtype(dev, prefer=dtype)
    return torch.amp.GradScaler(dev.type, enabled=dev.type == "cuda" and chosen == torch.float16)
