"""Rank side: synchronised BatchNorm: batch statistics over the whole global batch, on CPU too.

Under data parallelism each rank sees ``B / n`` samples; a plain ``BatchNorm``
normalises with the statistics of that small local batch, which gets noisy (and
different per rank) as ``n`` grows. SyncBatchNorm computes mean and variance over
every rank's samples, so the model behaves as if it saw the full batch at once.
Use it when the per-rank batch is small (detection, segmentation, large models).

torch's ``nn.SyncBatchNorm`` works only on GPUs (on CPU, DDP refuses it: "SyncBatchNorm
layers only work with GPU modules"). :class:`SyncBatchNorm` here runs on any backend:

- forward: one ``all_reduce`` of the per-channel sums, sums of squares and the element
  count; mean and (biased) variance follow, the running statistics get the unbiased
  variance exactly as ``nn.BatchNorm`` on the full batch would;
- backward: the gradient of the input depends on every rank's outputs through the
  shared mean and variance, so a second ``all_reduce`` sums ``dy`` and ``dy * x_hat``
  per channel (what torch's GPU version does). Weight and bias gradients stay local:
  DDP averages them like any other parameter.

:func:`convert_sync_batchnorm` picks torch's version on CUDA and this one otherwise.

Example (on every rank)::

    from nbdist.strategies.parallel.syncbn import convert_sync_batchnorm
    model = convert_sync_batchnorm(Net()).to(device)   # every BatchNorm*d replaced
    model = DDP(model)

Statistics are accumulated in float32 (or the input's type if wider) as
``E[x^2] - E[x]^2``; like any one-pass formula it loses precision when a channel's
mean is many orders of magnitude larger than its spread.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _stats_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _global_stats(x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean and biased variance per channel over every rank's ``x``, and the global count."""
    channels = x.shape[1]
    xs = x.detach().to(_stats_dtype(x))
    dims = _reduce_dims(x)
    local_count = x.numel() // channels if channels else 0
    # One collective for all three; float64 keeps the count exact and the sums precise.
    packed = torch.cat(
        [
            xs.sum(dims).double(),
            (xs * xs).sum(dims).double(),
            torch.tensor([local_count], dtype=torch.float64, device=x.device),
        ]
    )
    dist.all_reduce(packed, group=group)
    count = float(packed[-1])  # a device sync on GPU; the count is needed on the host anyway
    if count < 1:
        raise ValueError("SyncBatchNorm got an empty batch on every rank")
    mean = packed[:channels] / count
    var = (packed[channels : 2 * channels] / count - mean * mean).clamp_min(0)
    return mean, var, count


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalise with given global statistics; backward all-reduces the gradient sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, mean, invstd, count, group):
        """``x`` normalised with the given global ``mean``/``invstd``, then scaled and shifted."""
        shape = _channel_shape(x)
        dtype = _stats_dtype(x)
        xhat = (x.to(dtype) - mean.to(dtype).view(shape)) * invstd.to(dtype).view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(dtype).view(shape) + bias.to(dtype).view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(dtype))
        ctx.count = count
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = _reduce_dims(xhat)
        shape = _channel_shape(xhat)
        g = dy.to(xhat.dtype)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # Every rank's loss depends on this rank's x through the shared mean/variance.
            # The graph is the same on every rank, so all of them reach this collective.
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, group=ctx.group)
            channels = xhat.shape[1]
            mean_dy = (packed[:channels] / ctx.count).view(shape)
            mean_dy_xhat = (packed[channels:] / ctx.count).view(shape)
            scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
            grad_x = ((g - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)).to(dy.dtype)
        if weight is not None:
            # Local sums: DDP averages them over ranks like every other gradient.
            grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all ranks; works on CPU (gloo) and GPU (NCCL).

    Same arguments and state as ``nn.BatchNorm1d/2d/3d`` (any input ``(N, C, ...)``),
    plus ``process_group`` (default: the whole job). In eval mode, or outside a
    process group of more than one rank, it is a plain BatchNorm.

    Example::

        bn = SyncBatchNorm(16)
        y = bn(x)            # x: (N, 16) or (N, 16, H, W) on this rank
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        device=None,
        dtype=None,
    ) -> None:
        """Arguments as ``nn.BatchNorm2d``, plus ``process_group`` (default: every rank)."""
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, ...), got {tuple(x.shape)}"
            )
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got {x.shape[1]} channels in input "
                f"of shape {tuple(x.shape)}: channels are dim 1"
            )

    def _momentum_factor(self) -> float:
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` with the global batch's statistics in training, running ones in eval."""
        self._check_input_dim(x)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        synced = (
            use_batch_stats
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )
        if not synced:
            return super().forward(x)
        factor = self._momentum_factor()
        mean, var, count = _global_stats(x, self.process_group)
        if self.training and self.running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / max(count - 1.0, 1.0))
                self.running_mean.mul_(1 - factor).add_(
                    mean.to(self.running_mean.dtype), alpha=factor
                )
                self.running_var.mul_(1 - factor).add_(
                    unbiased.to(self.running_var.dtype), alpha=factor
                )
        invstd = torch.rsqrt(var + self.eps)
        return _SyncBatchNormFunction.apply(
            x, self.weight, self.bias, mean, invstd, count, self.process_group
        )


def _target_device(module: nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type == "cuda":
            return tensor.device
    from nbdist.engine.helpers import device as rank_device

    return rank_device()


def _convert(module: nn.Module, process_group) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
        )
        if module.affine:
            # The same Parameter objects: an optimizer built before still updates them.
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, _convert(child, process_group))
    return out


def convert_sync_batchnorm(module: nn.Module, process_group=None, *, device=None) -> nn.Module:
    """Replace every ``BatchNorm*d`` in ``module`` by a synchronised one; returns the module.

    On CUDA (``device``, else the module's CUDA tensors, else this rank's device) this
    is ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``; elsewhere it is
    :class:`SyncBatchNorm`, which torch does not provide for CPU. Parameters and
    running statistics are kept (the same tensors).

    Example::

        model = convert_sync_batchnorm(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm expects an nn.Module, got {type(module).__name__}")
    _check_group(process_group)
    if _target_device(module, device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    return _convert(module, process_group)


def _check_group(process_group) -> None:
    """Refuse what is no process group now, not at the first forward's collective."""
    import torch.distributed as dist

    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return
    hint = (
        "a DeviceMesh: pass one of its dimensions' groups, e.g. mesh.get_group('dp')"
        if type(process_group).__name__ == "DeviceMesh"
        else f"got {type(process_group).__name__} {process_group!r}"
    )
    raise TypeError(
        f"convert_sync_batchnorm: process_group must be a torch.distributed process group "
        f"(torch.distributed.new_group(ranks)) or None for every rank; {hint}"
    )
