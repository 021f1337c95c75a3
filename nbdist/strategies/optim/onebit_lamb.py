"""Rank side: 1-bit LAMB: LAMB's momentum all-reduced at one bit per number, with error feedback.

1-bit LAMB (Li et al. 2021, "1-bit LAMB: Communication Efficient Large-Scale
Large-Batch Training with LAMB's Convergence Speed"; DeepSpeed's
``OnebitLamb``) carries 1-bit Adam's recipe over to LAMB, whose per-layer
*trust ratio* ``||w|| / ||update||`` would be thrown off by compressed momentum:

1. **Warm-up** (the first ``freeze_step`` steps): plain LAMB
   (:class:`~nbdist.strategies.optim.optimizers.LAMB`), gradients all-reduced in fp32.
   Each tensor's trust ratio, clipped to ``[min_coeff, max_coeff]``, feeds an
   exponential average (``coeff_beta``).
2. **Compression**: the variance ``v`` is frozen and so is the average trust
   ratio. Each rank updates the momentum with its own gradient and the ranks
   average it at one bit per number with error feedback, exactly as 1-bit Adam
   does (:class:`~nbdist.strategies.optim.onebit_adam.OneBitOptimizer`, one tensor
   at a time). The frozen ratio is scaled by a *factor* that tracks how far the
   frozen variance has drifted: a fresh variance is kept from the gradients
   the averaged momentum implies, ``g = (m - b1 m_prev) / (1 - b1)``, and the
   factor is ``max(frozen denominator / fresh denominator)``, clipped to
   ``[factor_min, factor_max]`` and to +-``factor_threshold`` of its last value.

Two differences from DeepSpeed's code: each tensor is compressed on its own
(its own scales), so DeepSpeed's per-tensor momentum rescaling before a single
flat compression is not needed; and LAMB is bias-corrected as in the paper's
Algorithm 2, the average trust ratio too (DeepSpeed's starts at 0 and needs
``freeze_step >= 1 / (1 - coeff_beta)`` to forget that).

Costs, on top of 1-bit Adam's (error buffers, a full-price warm-up): a fresh
variance and the previous momentum per parameter; the payload per step is the
same, ``n/8 + n/(8 world)`` bytes plus two scales per tensor instead of ``4 n``.

Example::

    from nbdist.strategies.optim.onebit_lamb import apply_onebit_lamb
    opt = apply_onebit_lamb(model, lr=2e-3, freeze_step=50, weight_decay=0.01)
    loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss, sent_per_step_mib=opt.counter.take() / 2**20)
"""

from __future__ import annotations

import torch
from torch import nn

from nbdist.strategies.optim.compression import CommCounter
from nbdist.strategies.optim.onebit_adam import OneBitOptimizer, share_rank0_parameters
from nbdist.strategies.optim.optimizers import lamb_update

__all__ = ["OneBitLamb", "apply_onebit_lamb"]


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))  # .item(): a sync point on GPUs, once per tensor


class OneBitLamb(OneBitOptimizer):
    """LAMB for ``freeze_step`` steps, then frozen variance, 1-bit momentum, frozen trust ratio.

    ``lr``, ``betas``, ``eps``, ``weight_decay`` as in
    :class:`~nbdist.strategies.optim.optimizers.LAMB`, and so is a param group's
    ``trust_ratio`` (``False``: no ratio, as for biases). The warm-up equals
    that LAMB on the global batch (apart from the clip of the ratio to
    ``[min_coeff, max_coeff]``). ``coeff_beta``, ``factor_min``,
    ``factor_max``, ``factor_threshold``: see the module docstring
    (DeepSpeed's defaults). Keeps ``counter`` (bytes sent), ``steps`` and
    ``coefficients`` (the ratio each tensor used in the last step).

    Example::

        opt = OneBitLamb(model.parameters(), lr=2e-3, freeze_step=100)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        *,
        freeze_step: int = 100,
        min_coeff: float = 0.01,
        max_coeff: float = 10.0,
        coeff_beta: float = 0.9,
        factor_min: float = 0.5,
        factor_max: float = 4.0,
        factor_threshold: float = 0.1,
        group=None,
        counter: CommCounter | None = None,
    ) -> None:
        """See the class docstring; ``group``: the process group (default: all ranks)."""
        if not (0 < min_coeff <= max_coeff and 0 < factor_min <= 1 <= factor_max):
            raise ValueError(
                f"need 0 < min_coeff <= max_coeff and 0 < factor_min <= 1 <= factor_max; got "
                f"min_coeff={min_coeff}, max_coeff={max_coeff}, factor_min={factor_min}, "
                f"factor_max={factor_max}"
            )
        if not (0 <= coeff_beta < 1 and factor_threshold >= 0):
            raise ValueError(
                f"need 0 <= coeff_beta < 1 and factor_threshold >= 0; got coeff_beta={coeff_beta}, "
                f"factor_threshold={factor_threshold}"
            )
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        defaults["trust_ratio"] = True
        super().__init__(
            params,
            defaults,
            freeze_step=freeze_step,
            group=group,
            counter=counter,
            name="OneBitLamb",
        )
        self.coeff_range = (min_coeff, max_coeff)
        self.coeff_beta = coeff_beta
        self.factor_range = (factor_min, factor_max)
        self.factor_threshold = factor_threshold
        self.coefficients: list[float] = []

    @torch.no_grad()
    def step(self, closure=None):
        """One update: LAMB with all-reduced gradients, or 1-bit momentum after the warm-up."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs, grads, warmup = self.begin_step()
        self.coefficients = []
        for (p, group), grad in zip(pairs, grads):
            state = self.state[p]
            if not state:
                state.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state.update(coeff_average=0.0, factor=1.0)
            if warmup:
                update = self._lamb_update(p, group, grad, state)
            else:
                update = self._compressed_update(p, group, grad, state)
            p.sub_(update, alpha=group["lr"])
        return loss

    def _lamb_update(self, p, group, grad, state) -> torch.Tensor:
        # optimizers.LAMB's own update (bias-corrected at step t), then a clipped ratio.
        update = lamb_update(p, grad, state["exp_avg"], state["exp_avg_sq"], self.steps, group)
        if self.steps == self.freeze_step:  # the fresh variance starts from the frozen one
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        if group["trust_ratio"]:
            w_norm, u_norm = _norm(p), _norm(update)
            ratio = w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0
            ratio = min(max(ratio, self.coeff_range[0]), self.coeff_range[1])
            b = self.coeff_beta
            state["coeff_average"] = b * state["coeff_average"] + (1 - b) * ratio
            update.mul_(ratio)
            self.coefficients.append(ratio)
        return update

    def _compressed_update(self, p, group, grad, state) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        t, frozen_at = self.steps, self.freeze_step
        m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
        m_prev = m.clone()
        m.mul_(beta1).add_(grad, alpha=1 - beta1)  # this rank's own gradient...
        self.average_momentum(p, m)  # ...averaged through the momentum, at 1 bit
        implied = (m - beta1 * m_prev).div_(1 - beta1)  # the gradient m moved by
        fresh.mul_(beta2).addcmul_(implied, implied, value=1 - beta2)
        denom = (v / (1 - beta2**frozen_at)).sqrt_().add_(group["eps"])
        update = (m / (1 - beta1**t)).div_(denom)
        adam_norm = _norm(update)
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        if not group["trust_ratio"]:
            return update
        fresh_denom = (fresh / (1 - beta2**t)).sqrt_().add_(group["eps"])
        factor = float((denom / fresh_denom).max())
        if group["weight_decay"]:
            # Weight decay is not affected by the stale variance: scale only Adam's share.
            share = min(1.0, adam_norm / max(_norm(update), 1e-30))
            factor = factor * share + (1 - share)
        low, high = self.factor_range
        last, step = state["factor"], self.factor_threshold
        factor = min(max(factor, low, last * (1 - step)), high, last * (1 + step))
        state["factor"] = factor
        average = state["coeff_average"] / (1 - self.coeff_beta**frozen_at)
        self.coefficients.append(average * factor)
        return update.mul_(average * factor)


def apply_onebit_lamb(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    freeze_step: int = 100,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    min_coeff: float = 0.01,
    max_coeff: float = 10.0,
    coeff_beta: float = 0.9,
    factor_min: float = 0.5,
    factor_max: float = 4.0,
    factor_threshold: float = 0.1,
    group=None,
) -> OneBitLamb:
    """Copy rank 0's parameters to every rank and return a :class:`OneBitLamb` for ``model``.

    ``model`` must not be wrapped in DDP: the optimizer averages across ranks
    itself. The arguments are :class:`OneBitLamb`'s.

    Example::

        opt = apply_onebit_lamb(model, lr=2e-3, freeze_step=50, weight_decay=0.01)
    """
    from nbdist.strategies.arguments import require_module

    require_module(model, "apply_onebit_lamb")
    opt = OneBitLamb(
        model.parameters(),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        freeze_step=freeze_step,
        min_coeff=min_coeff,
        max_coeff=max_coeff,
        coeff_beta=coeff_beta,
        factor_min=factor_min,
        factor_max=factor_max,
        factor_threshold=factor_threshold,
        group=group,
    )
    share_rank0_parameters(model, group=group, caller="apply_onebit_lamb")
    return opt
