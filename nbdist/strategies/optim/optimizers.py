"""Rank side: large-batch optimizers (LARS, LAMB) and the memory an optimizer keeps.

Large-batch training raises the learning rate with the batch (see
:mod:`nbdist.strategies.optim.large_batch`); past a few thousand samples per step plain
SGD/Adam diverge because one global rate is too large for some layers and too
small for others. LARS and LAMB rescale each layer's update by a *trust ratio*
``||w|| / ||update||``, so every layer moves by a similar fraction of its weights.

- :class:`LARS` (You, Gitman, Ginsburg 2017, "Large Batch Training of
  Convolutional Networks"): SGD with momentum, local rate
  ``eta * ||w|| / (||g|| + weight_decay * ||w||)``.
- :class:`LAMB` (You et al. 2019, "Large Batch Optimization for Deep Learning:
  Training BERT in 76 minutes", Algorithm 2): Adam's moments, then the update
  ``r + weight_decay * w`` scaled by ``||w|| / ||r + weight_decay * w||``.

Both are plain ``torch.optim.Optimizer`` subclasses: they work with DDP (which
averages the gradients before ``step``), LR schedulers and ``state_dict``.
Parameters with one dimension (biases, norm weights) usually skip the trust
ratio and weight decay: put them in a param group with ``trust_ratio=False``
and ``weight_decay=0`` (:func:`exclude_bias_and_norm` builds those groups).

Example::

    from nbdist.strategies.optim.optimizers import LAMB, exclude_bias_and_norm, state_bytes
    opt = LAMB(exclude_bias_and_norm(model, weight_decay=0.01), lr=2e-3)
    ...
    print(state_bytes(opt))   # bytes of optimizer state held by this rank
"""

from __future__ import annotations

import torch
from torch import nn

from nbdist.strategies.arguments import require_module, require_numbers, require_params
from nbdist.strategies.measure import local_bytes

__all__ = ["LAMB", "LARS", "exclude_bias_and_norm", "lamb_update", "state_bytes"]


def _trust(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    # The papers' ratio, with 1 where a norm is zero (fresh zero-initialised
    # weights, or a zero update) so those layers still move.
    ok = (numerator > 0) & (denominator > 0)
    return torch.where(ok, numerator / denominator.clamp_min(1e-30), torch.ones_like(numerator))


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling: SGD + momentum with a per-layer trust ratio.

    For each parameter ``w`` with gradient ``g`` (Algorithm 1 of the paper)::

        local_lr = eta * ||w|| / (||g|| + weight_decay * ||w||)     # 1 if a norm is 0
        v = momentum * v + lr * local_lr * (g + weight_decay * w)
        w = w - v

    A group with ``trust_ratio=False`` uses ``local_lr = 1`` (plain SGD + momentum).

    Example::

        opt = LARS(model.parameters(), lr=scaled_lr(0.1, 4096), momentum=0.9,
                   weight_decay=5e-4, eta=0.001)
    """

    def __init__(
        self,
        params,
        lr: float = 0.1,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        trust_ratio: bool = True,
    ) -> None:
        """LARS over ``params``: ``lr``, momentum, weight decay and trust coefficient ``eta``."""
        require_params(params, "LARS")
        require_numbers("LARS", lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta)
        if lr < 0 or momentum < 0 or weight_decay < 0 or eta <= 0:
            raise ValueError(
                f"LARS needs lr >= 0, momentum >= 0, weight_decay >= 0 and eta > 0; got "
                f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}, eta={eta}"
            )
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, trust_ratio=trust_ratio
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One LARS update (``closure`` re-evaluates the loss, as in torch's optimizers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd, eta = group["weight_decay"], group["eta"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["trust_ratio"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    local_lr = eta * _trust(w_norm, g_norm + wd * w_norm)
                else:
                    local_lr = 1.0
                update = g.add(p, alpha=wd) if wd else g.clone()
                update.mul_(local_lr * group["lr"])
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = update
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(update)
                p.sub_(state["momentum_buffer"])
        return loss


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training: Adam with a per-layer trust ratio.

    For each parameter ``w`` at step ``t`` (Algorithm 2 of the paper, bias-corrected)::

        m = beta1 * m + (1 - beta1) * g          v = beta2 * v + (1 - beta2) * g**2
        r = (m / (1 - beta1**t)) / (sqrt(v / (1 - beta2**t)) + eps)
        u = r + weight_decay * w
        w = w - lr * (||w|| / ||u||) * u         # ratio 1 if a norm is 0

    With ``trust_ratio=False`` the step is AdamW's (decoupled weight decay).

    Example::

        opt = LAMB(model.parameters(), lr=2e-3, weight_decay=0.01)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_ratio: bool = True,
    ) -> None:
        """LAMB over ``params``: ``lr``, Adam's betas and eps, weight decay, ``trust_ratio``."""
        require_params(params, "LAMB")
        require_numbers("LAMB", lr=lr, eps=eps, weight_decay=weight_decay)
        if lr < 0 or eps <= 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"LAMB needs lr >= 0, eps > 0, weight_decay >= 0 and 0 <= betas < 1; got "
                f"lr={lr}, eps={eps}, weight_decay={weight_decay}, betas={betas}"
            )
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, trust_ratio=trust_ratio
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One LAMB update (``closure`` re-evaluates the loss, as in torch's optimizers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                update = lamb_update(
                    p, g, state["exp_avg"], state["exp_avg_sq"], state["step"], group
                )
                if group["trust_ratio"]:
                    ratio = _trust(torch.linalg.vector_norm(p), torch.linalg.vector_norm(update))
                    update.mul_(ratio)
                p.sub_(update, alpha=group["lr"])
        return loss


def lamb_update(p, grad, m, v, t: int, group: dict) -> torch.Tensor:
    """LAMB's update for ``p`` at step ``t``, before the trust ratio; advances ``m`` and ``v`` in place.

    ``m``/``v``: Adam's moments of ``p``; ``group``: its ``betas``, ``eps`` and
    ``weight_decay``. Returns ``m̂ / (sqrt(v̂) + eps) + weight_decay * p`` (bias-corrected),
    a new tensor. Shared by :class:`LAMB` and 1-bit LAMB's warm-up, which must match it.
    """
    beta1, beta2 = group["betas"]
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
    update = (m / (1 - beta1**t)).div_(denom)
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    return update


def exclude_bias_and_norm(model: nn.Module, *, weight_decay: float) -> list[dict]:
    """Two param groups: matrices (trust ratio, weight decay) and 1-d tensors (neither).

    Biases and normalisation weights are tiny and their norms say little about a
    good step size; the LARS/LAMB papers' reference code skips them.

    Example::

        opt = LARS(exclude_bias_and_norm(model, weight_decay=5e-4), lr=1.0)
    """
    require_module(model, "exclude_bias_and_norm")
    require_numbers("exclude_bias_and_norm", weight_decay=weight_decay)
    matrices, vectors = [], []
    for p in model.parameters():
        if p.requires_grad:
            (vectors if p.ndim <= 1 else matrices).append(p)
    return [
        {"params": matrices, "weight_decay": weight_decay},
        {"params": vectors, "weight_decay": 0.0, "trust_ratio": False},
    ]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer's state on this rank (moments, buffers, step counters).

    Only this rank's shard is counted for sharded tensors. Adam keeps two full
    copies of every parameter; Adafactor keeps a row and a column vector per matrix.

    Example::

        state_bytes(torch.optim.Adam(model.parameters()))   # 0 until the first step
    """
    return local_bytes(value for state in optimizer.state.values() for value in state.values())
