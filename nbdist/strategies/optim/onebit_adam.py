"""Rank side: 1-bit Adam: Adam's momentum all-reduced as one bit per number, with error feedback.

1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed"; DeepSpeed's ``OnebitAdam``) rests on
one observation: Adam's variance ``v`` stops changing much after a warm-up. So:

1. **Warm-up** (the first ``freeze_step`` steps): plain Adam, gradients
   all-reduced in fp32 (4 bytes per parameter per rank).
2. **Compression**: ``v`` is frozen, which makes Adam a momentum SGD with a
   fixed per-coordinate scale. Each rank updates the momentum with its *own*
   gradient, ``m = b1 m + (1 - b1) g_local``, and the ranks average ``m`` with
   :func:`compressed_allreduce`: every number travels as its sign (1 bit) times
   one scale per tensor, twice (to the rank that owns a chunk, then back to
   everyone). What the signs lose is kept on each rank (*error feedback*: the
   worker's and the chunk owner's errors) and added before the next
   compression, so over steps nothing is lost, only delayed. Each parameter
   tensor is compressed on its own (its own scales: one scale for the whole
   model would give a layer with small momentum huge steps). Payload per rank:
   ``n/8 + n/(8 world)`` bytes instead of ``4 n`` (21x less on 2 ranks, up to 32x on many).

Costs: a warm-up at full price; error buffers (one parameter-sized, one
``1/world`` of it) per rank; the update uses a stale variance and a delayed,
noisier momentum, so it may need a few more steps for the same loss.

:class:`OneBitAdam` does the communication itself: do not wrap the model in
DDP (DDP would all-reduce the gradients again). :func:`apply_onebit_adam`
broadcasts rank 0's parameters and returns the optimizer. ``opt.counter``
counts the bytes sent (a :class:`~nbdist.strategies.optim.compression.CommCounter`).
:class:`OneBitOptimizer` holds what the 1-bit optimizers share (the warm-up
all-reduce, the per-tensor compressed momentum, the byte counter);
:mod:`nbdist.strategies.optim.onebit_lamb` builds 1-bit LAMB on it.

Example::

    from nbdist.strategies.optim.onebit_adam import apply_onebit_adam
    opt = apply_onebit_adam(model, lr=1e-3, freeze_step=50)
    loss.backward(); opt.step()
    nbdist.log(step=step, loss=loss, sent_per_step_mib=opt.counter.take() / 2**20)
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from nbdist.strategies.optim.compression import CommCounter

__all__ = [
    "OneBitAdam",
    "OneBitOptimizer",
    "apply_onebit_adam",
    "compressed_allreduce",
    "onebit_compress",
    "pack_signs",
    "padded_length",
    "share_rank0_parameters",
    "unpack_signs",
]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """The signs of ``x`` (length a multiple of 8), 8 to a byte: bit set where ``x >= 0``.

    Example::

        pack_signs(torch.tensor([1., -1, 1, 1, -1, -1, -1, 2]))   # tensor([177], dtype=uint8)
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a length divisible by 8, got {x.numel()}")
    bits = (x.reshape(-1, 8) >= 0).to(torch.uint8) * _BITS.to(x.device)
    return bits.sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """+1/-1 for each bit of ``packed`` (uint8), as written by :func:`pack_signs`."""
    bits = (packed.reshape(-1, 1) & _BITS.to(packed.device)) != 0
    return (bits.to(dtype) * 2 - 1).reshape(-1)


def onebit_compress(
    x: torch.Tensor, error: torch.Tensor, *, valid: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress ``x + error`` to signs and one scale; ``error`` becomes what that lost.

    Returns ``(packed signs, scale)``; the decompressed value is
    ``scale * unpack_signs(packed)``. The scale is the root mean square of
    ``x + error`` (DeepSpeed's choice: it keeps the L2 norm). ``valid``: only
    the first ``valid`` entries are real (the rest is padding, kept at zero
    error). Error feedback: ``sum of decompressed values = sum of x - error``
    after any number of calls, so the loss is delayed, not accumulated.

    Example::

        error = torch.zeros(8)
        packed, scale = onebit_compress(torch.arange(8.0) - 3, error)
    """
    valid = x.numel() if valid is None else valid
    corrected = x + error
    scale = corrected[:valid].norm() / math.sqrt(max(valid, 1))
    packed = pack_signs(corrected)
    error.copy_(corrected - scale * unpack_signs(packed, x.dtype))
    error[valid:] = 0
    return packed, scale


def compressed_allreduce(
    tensor: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    *,
    group=None,
    counter: CommCounter | None = None,
) -> torch.Tensor:
    """Average the flat fp32 ``tensor`` over the ranks at one bit per number, in place.

    Two compressions with error feedback, as in DeepSpeed: each rank compresses
    ``tensor`` and sends chunk ``j`` to rank ``j`` (``all_to_all``, with its
    scale); rank ``j`` averages the decompressed chunks, compresses that again
    and gathers it back to all. ``worker_error`` (length ``padded``) and
    ``server_error`` (``padded / world``), zeros at first and kept between
    calls, with ``padded`` the length rounded up to a multiple of ``8 * world``
    . Every rank gets bitwise the same result.

    Example::

        worker, server = torch.zeros(64), torch.zeros(32)      # 2 ranks, 50 numbers
        avg = compressed_allreduce(m.clone(), worker, server)  # m: 50 numbers
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    n = tensor.numel()
    padded = worker_error.numel()
    chunk = padded // world
    if padded % (8 * world) or padded < n or server_error.numel() != chunk:
        raise ValueError(
            f"error buffers of {padded} and {server_error.numel()} numbers do not fit a tensor of "
            f"{n} on {world} ranks: use {padded_length(n, world)} and "
            f"{padded_length(n, world) // world}"
        )
    flat = torch.zeros(padded, dtype=tensor.dtype, device=tensor.device)
    flat[:n] = tensor.reshape(-1)
    packed, scale = onebit_compress(flat, worker_error, valid=n)

    # Stage 1: chunk j of every rank's signs goes to rank j, with every rank's scale.
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    scales = torch.empty(world, dtype=tensor.dtype, device=tensor.device)
    _gather(scales, scale.reshape(1), group=group)
    signs = unpack_signs(received, tensor.dtype).reshape(world, chunk)
    mine = (signs * scales.reshape(world, 1)).sum(0) / world

    # Stage 2: this rank's chunk, compressed again, goes to everyone.
    valid = min(max(n - rank * chunk, 0), chunk)
    mine_packed, mine_scale = onebit_compress(mine, server_error, valid=valid)
    all_packed = torch.empty(padded // 8, dtype=torch.uint8, device=tensor.device)
    _gather(all_packed, mine_packed, group=group)
    server_scales = torch.empty(world, dtype=tensor.dtype, device=tensor.device)
    _gather(server_scales, mine_scale.reshape(1), group=group)
    result = unpack_signs(all_packed, tensor.dtype).reshape(world, chunk)
    result = (result * server_scales.reshape(world, 1)).reshape(-1)[:n]
    if counter is not None:
        size = tensor.element_size()
        counter.add(packed.numel() + size + mine_packed.numel() + size, dense=n * size)
    tensor.copy_(result.reshape(tensor.shape))
    return tensor


def _gather(output: torch.Tensor, mine: torch.Tensor, group=None) -> None:
    from nbdist.engine.backend_support import tensor_all_gather

    tensor_all_gather()(output, mine, group=group)


def padded_length(n: int, world: int) -> int:
    """Length of the error buffer for ``n`` numbers on ``world`` ranks: a multiple of ``8 world``.

    Example::

        padded_length(50, 2)   # 64; the server error buffer is 64 // 2 = 32
    """
    step = 8 * world
    return max(step, -(-n // step) * step)


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers: warm-up all-reduce, compressed momentum, bytes counted.

    A subclass's ``step`` calls :meth:`begin_step` for the parameters and the
    gradients to use (averaged over the ranks during the warm-up, this rank's
    own after it) and :meth:`average_momentum` for each momentum once the
    warm-up is over. Keeps ``freeze_step``, ``steps`` (taken so far),
    ``counter`` (bytes sent) and ``process_group``.

    Example::

        pairs, grads, warmup = self.begin_step()   # in a subclass's step
    """

    def __init__(
        self, params, defaults: dict, *, freeze_step: int, group=None, counter=None, name: str
    ) -> None:
        """Check ``freeze_step``, ``defaults["betas"]`` and the process group; ``name`` is for errors."""
        from nbdist.strategies.arguments import require_numbers, require_params, require_whole

        require_params(params, name)
        numbers = {k: defaults[k] for k in ("lr", "eps", "weight_decay") if k in defaults}
        require_numbers(name, **numbers)
        # A step count: the warm-up ends when steps == freeze_step, never for 2.5.
        require_whole(name, freeze_step=freeze_step)
        for arg, value in numbers.items():
            if not value >= 0:  # torch.optim.Adam refuses these too; a minus sign is a typo
                fix = -value if math.isfinite(value) else {"lr": 1e-3, "eps": 1e-8}.get(arg, 0.0)
                raise ValueError(f"{name}: {arg}={value!r} must be >= 0: pass e.g. {arg}={fix!r}")
        if freeze_step < 1:
            raise ValueError(
                f"freeze_step={freeze_step}: the variance needs at least one warm-up step "
                "before it is frozen; use 10-25 % of the training steps"
            )
        betas = defaults["betas"]
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{name} needs a process group: run it on the ranks (%%on_all_ranks) "
                "or call torch.distributed.init_process_group first"
            )
        super().__init__(params, defaults)
        self._name = name
        self.freeze_step = freeze_step
        self.process_group = group
        self.counter = counter if counter is not None else CommCounter()
        self.steps = 0
        self._world = dist.get_world_size(group)

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over: the next steps send 1-bit momentum."""
        return self.steps >= self.freeze_step

    def begin_step(self) -> tuple[list, list[torch.Tensor], bool]:
        """Count the step; return ``(pairs, grads, warmup)``: (parameter, its group) pairs,
        their gradients, and whether this step is a warm-up step.

        Warm-up gradients are averaged over the ranks (one fp32 all-reduce of
        all of them, as DDP would do, counted); afterwards they are this
        rank's own. Frozen parameters (``requires_grad=False``) are left out,
        untouched as in torch's optimizers; a trainable one's missing gradient
        counts as zero, so the ranks' calls match.
        """
        pairs = [(p, g) for g in self.param_groups for p in g["params"] if p.requires_grad]
        if self.steps == 0:
            self._check_same_parameters(pairs)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p, _ in pairs]
        warmup = self.steps + 1 <= self.freeze_step
        late = [p for p, _ in pairs if not self.state[p]]
        if not warmup and late:
            # Unfrozen after the warm-up: no variance was gathered to freeze (a step of lr / eps).
            raise ValueError(
                f"{self._name}: {len(late)} parameter(s) (the first of shape "
                f"{tuple(late[0].shape)}) became trainable after the warm-up (freeze_step="
                f"{self.freeze_step}) and have no variance to freeze: unfreeze them before "
                "step freeze_step, or build a new optimizer"
            )
        self.steps += 1
        if warmup and pairs:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(self._world)
            self.counter.add(flat.numel() * flat.element_size())
            grads = [
                g.view(p.shape)
                for g, (p, _) in zip(torch.split(flat, [p.numel() for p, _ in pairs]), pairs)
            ]
        return pairs, grads, warmup

    def _check_same_parameters(self, pairs: list) -> None:
        # Every rank must send the same tensors, or the all-reduces do not match and gloo
        # aborts (or the cell hangs): one rank froze a layer the others train.
        mine = [len(pairs), sum(p.numel() for p, _ in pairs)]
        device = next((p.device for g in self.param_groups for p in g["params"]), None)
        both = torch.tensor([*mine, *(-n for n in mine)], device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.process_group)
        high, low = both[:2].tolist(), (-both[2:]).tolist()
        if high != low:
            raise ValueError(
                f"{self._name}: the ranks train different parameters (this rank {mine[0]} tensors "
                f"of {mine[1]} numbers; {low[0]} to {high[0]} tensors across the ranks): "
                "freeze the same layers (requires_grad_(False)) on every rank"
            )

    def average_momentum(self, p: torch.Tensor, exp_avg: torch.Tensor) -> None:
        """Average ``p``'s momentum over the ranks at one bit per number, in place.

        Each tensor on its own (its own scales), with its error buffers kept in
        ``self.state[p]`` (``worker_error``, ``server_error``).
        """
        state = self.state[p]
        if "worker_error" not in state:
            padded = padded_length(p.numel(), self._world)
            state["worker_error"] = torch.zeros(padded, dtype=p.dtype, device=p.device)
            state["server_error"] = torch.zeros(
                padded // self._world, dtype=p.dtype, device=p.device
            )
        compressed_allreduce(
            exp_avg,
            state["worker_error"],
            state["server_error"],
            group=self.process_group,
            counter=self.counter,
        )


class OneBitAdam(OneBitOptimizer):
    """Adam for ``freeze_step`` steps, then frozen variance and 1-bit compressed momentum.

    ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled, as AdamW) as in
    Adam; bias correction as ``torch.optim.Adam`` (the variance's frozen at
    ``freeze_step``). Warm-up steps all-reduce the gradients (one flat fp32
    buffer) and equal ``torch.optim.Adam`` on the global batch. After that each
    parameter's momentum is compressed on its own, as DeepSpeed does, so each
    tensor (a layer's weight, a bias) gets its own scales. Every trainable
    parameter takes part on every rank (a missing gradient counts as zero), so
    the ranks' calls match; frozen ones (``requires_grad=False``) are not
    touched, weight decay included. Keeps ``counter`` (bytes sent) and ``steps``.

    Example::

        opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=100)
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int = 100,
        group=None,
        counter: CommCounter | None = None,
    ) -> None:
        """See the class docstring; ``group``: the process group (default: all ranks)."""
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(
            params,
            defaults,
            freeze_step=freeze_step,
            group=group,
            counter=counter,
            name="OneBitAdam",
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One update: Adam with all-reduced gradients, or 1-bit momentum after the warm-up."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs, grads, warmup = self.begin_step()
        variance_steps = min(self.steps, self.freeze_step)
        for (p, group), grad in zip(pairs, grads):
            state = self.state[p]
            beta1, beta2 = group["betas"]
            if not state:
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            # Warm-up: the averaged gradient. After: this rank's own, averaged through m.
            exp_avg.lerp_(grad, 1 - beta1)
            if warmup:
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                self.average_momentum(p, exp_avg)
            step_size = group["lr"] / (1 - beta1**self.steps)
            denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**variance_steps)).add_(group["eps"])
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss


def share_rank0_parameters(model: nn.Module, *, group=None, caller: str) -> None:
    """Copy rank 0's parameters and buffers to every rank; refuse a DDP-wrapped ``model``.

    The 1-bit optimizers average across ranks themselves: under DDP the
    gradients would be all-reduced twice. ``caller`` names the function in the error.

    Example::

        share_rank0_parameters(model, caller="apply_onebit_adam")
    """
    from torch.nn.parallel import DistributedDataParallel

    from nbdist.strategies.arguments import require_module

    require_module(model, caller)
    if isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"{caller} got a DistributedDataParallel model: DDP would all-reduce the "
            "gradients that the 1-bit optimizer compresses; pass the plain module (model.module)"
        )
    root = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, root, group=group)


def apply_onebit_adam(
    model: nn.Module,
    *,
    lr: float = 1e-3,
    freeze_step: int = 100,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    group=None,
) -> OneBitAdam:
    """Copy rank 0's parameters to every rank and return a :class:`OneBitAdam` for ``model``.

    ``model`` must not be wrapped in DDP: the optimizer averages across ranks itself.

    Example::

        opt = apply_onebit_adam(model, lr=1e-3, freeze_step=50)
    """
    from nbdist.strategies.arguments import require_module

    require_module(model, "apply_onebit_adam")
    opt = OneBitAdam(
        model.parameters(),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        freeze_step=freeze_step,
        group=group,
    )
    share_rank0_parameters(model, group=group, caller="apply_onebit_adam")
    return opt
