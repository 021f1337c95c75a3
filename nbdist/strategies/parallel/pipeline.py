"""Rank side: pipeline parallelism: consecutive layers on consecutive ranks, micro-batches flowing through.

Rank 0 holds the first layers (stage 0), rank 1 the next ones, and so on;
only activations (forward) and their gradients (backward) cross between
ranks. A batch is cut into ``n_microbatches`` so that stage 1 can work on
micro-batch 1 while stage 0 starts micro-batch 2. Stages still idle at the
start and the end of each step (the *bubble*): with ``p`` stages and ``m``
micro-batches the idle share is ``(p - 1) / (m + p - 1)``. GPipe runs every
forward, then every backward (activations of all ``m`` micro-batches live at
once); 1F1B alternates one forward and one backward after a warm-up, so at
most ``p`` micro-batches' activations are alive, for the same bubble. Use it
when the model does not fit one device and links between devices are slow
(only activations travel, once per layer boundary).

Example (on every rank; ``model`` is an ``nn.Sequential``)::

    from nbdist.strategies.parallel.pipeline import pipeline_schedule
    stage, schedule = pipeline_schedule(model, n_microbatches=8, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    losses = []
    if stage.is_first:
        schedule.step(x)                          # feeds the micro-batches in
    elif stage.is_last:
        schedule.step(target=y, losses=losses)    # one loss per micro-batch
    else:
        schedule.step()                           # middle stages (more than 2 ranks)
    opt.step()
"""

from __future__ import annotations

import time

import torch
from torch import nn

__all__ = [
    "SCHEDULES",
    "StageTimer",
    "bubble_fraction",
    "contiguous_inputs",
    "pipeline_schedule",
    "render_timeline",
    "split_sequential",
]

SCHEDULES = ("gpipe", "1f1b")


def split_sequential(model: nn.Sequential, n_stages: int) -> list[nn.Sequential]:
    """Cut ``model`` into ``n_stages`` consecutive parts with about equal parameter counts.

    Layers are not copied: the parts share them with ``model``.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"split_sequential needs an nn.Sequential (layers in execution order), got "
            f"{type(model).__name__}; write the model as nn.Sequential(...) or split it by hand"
        )
    layers = list(model)
    from nbdist.strategies.arguments import require_whole

    require_whole("split_sequential", n_stages=n_stages)
    if not 1 <= n_stages <= len(layers):
        raise ValueError(
            f"cannot split {len(layers)} layers into {n_stages} stages: use 1..{len(layers)} stages"
        )
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(sizes) or 1
    parts: list[list[nn.Module]] = []
    i, seen = 0, 0
    for stage in range(n_stages):
        part: list[nn.Module] = []
        later = n_stages - stage - 1
        # Leave at least one layer for each later stage; the last stage takes the rest.
        target = total * (stage + 1) / n_stages
        while i < len(layers) - later:
            # Stop where the running total lands closest to this stage's share.
            if part and later and abs(seen + sizes[i] - target) > abs(seen - target):
                break
            part.append(layers[i])
            seen += sizes[i]
            i += 1
        parts.append(part)
    return [nn.Sequential(*p) for p in parts]


def pipeline_schedule(
    model: nn.Sequential,
    *,
    n_microbatches: int,
    loss_fn,
    schedule: str = "1f1b",
    device=None,
):
    """This rank's ``PipelineStage`` (its part of ``model``) and the schedule that runs it.

    ``model`` is split over all ranks (:func:`split_sequential`); this rank
    keeps part ``rank`` and moves it to ``device`` (default: this rank's).
    ``schedule`` is ``"gpipe"`` or ``"1f1b"``. Gradients are those of the mean
    of the micro-batch losses (= the full-batch loss for a mean loss);
    ``loss_fn=None`` runs forward only (inference: no loss, no gradients).
    Tensors given to ``schedule.step`` may be strided views (``x[rank::dp]``):
    the stage gets contiguous micro-batches (:func:`contiguous_inputs`).
    """
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from nbdist.engine.backend_support import require
    from nbdist.engine.helpers import device as rank_device

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    from nbdist.strategies.arguments import require_whole

    require_whole("pipeline_schedule", n_microbatches=n_microbatches)
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    # None is torch's forward-only schedule (inference); anything else must be called.
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"pipeline_schedule: loss_fn={loss_fn!r} is no function: give the last stage's loss, "
            "e.g. loss_fn=nn.functional.mse_loss (None: forward only, no gradients)"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "pipeline_schedule needs a torch.distributed process group: call it on the ranks "
            "(in a %%on_all_ranks cell after %dist_start)"
        )
    # Stages hand activations and gradients to their neighbours point to point.
    require("pipeline parallel (pipeline_schedule)", ("send/recv",))
    rank, world = dist.get_rank(), dist.get_world_size()
    if schedule == "1f1b" and n_microbatches < world:
        raise ValueError(
            f"1F1B needs at least as many micro-batches as stages: n_microbatches={n_microbatches} "
            f"< {world} stages; use n_microbatches >= {world}"
        )
    device = torch.device(device) if device is not None else rank_device()
    part = split_sequential(model, world)[rank].to(device)
    stage = PipelineStage(part, rank, world, device)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return stage, contiguous_inputs(cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn))


def contiguous_inputs(schedule):
    """``schedule`` whose ``step`` hands the stage contiguous copies of strided tensors.

    A data-parallel share taken as ``x[rank::dp]`` (or ``seq[:, :-1]``) is a strided
    view. torch 2.11's first stage infers its input's metadata from a ``meta`` copy,
    which is contiguous, then checks every micro-batch's strides against it: the
    strided batch failed with "stride mismatch: expected (16, 1) actual (34, 1)"
    (example 26 on a GPU). A contiguous tensor is passed as it is (no copy).
    """
    step = schedule.step

    def step_with_contiguous_inputs(*args, **kwargs):
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {
            k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
        }
        return step(*args, **kwargs)

    step_with_contiguous_inputs.__doc__ = step.__doc__
    schedule.step = step_with_contiguous_inputs
    return schedule


def bubble_fraction(n_stages: int, n_microbatches: int) -> float:
    """The idle share of a GPipe/1F1B step with equal stages: ``(p - 1) / (m + p - 1)``."""
    from nbdist.strategies.arguments import require_whole

    require_whole("bubble_fraction", n_stages=n_stages, n_microbatches=n_microbatches)
    if n_stages < 1 or n_microbatches < 1:
        raise ValueError(
            f"bubble_fraction needs n_stages >= 1 and n_microbatches >= 1, got "
            f"n_stages={n_stages}, n_microbatches={n_microbatches}"
        )
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


class StageTimer:
    """Seconds this rank's stage computes inside a schedule: its forward and backward chunks.

    It wraps the stage's ``forward_one_chunk``/``backward_one_chunk`` (the
    schedules call them once per micro-batch, between the receives and sends),
    so the time waiting for neighbours is left out: a step's idle share is
    ``1 - timer.busy / step_seconds``. ``events`` holds ``(kind, micro_batch,
    start, end)`` per chunk (kind ``"F"`` or ``"B"``, ``time.perf_counter()``
    seconds) for :func:`render_timeline`.

    Example::

        timer = StageTimer(stage)
        schedule.step(x)                      # or step(target=y, losses=...)
        timer.forward / timer.forwards        # seconds per micro-batch forward
        timer.reset()
    """

    def __init__(self, stage) -> None:
        """Time ``stage``'s forward and backward chunks from now on."""
        self.reset()
        self._wrap(stage, "forward_one_chunk", "F")
        self._wrap(stage, "backward_one_chunk", "B")

    def reset(self) -> None:
        """Start counting from zero (e.g. at the start of each step)."""
        self.events: list[tuple[str, int, float, float]] = []

    @property
    def forward(self) -> float:
        """Seconds of forward compute since the last :meth:`reset`."""
        return sum(e - s for k, _, s, e in self.events if k == "F")

    @property
    def backward(self) -> float:
        """Seconds of backward compute since the last :meth:`reset`."""
        return sum(e - s for k, _, s, e in self.events if k == "B")

    @property
    def forwards(self) -> int:
        """Micro-batch forwards timed."""
        return sum(k == "F" for k, *_ in self.events)

    @property
    def backwards(self) -> int:
        """Micro-batch backwards timed."""
        return sum(k == "B" for k, *_ in self.events)

    @property
    def busy(self) -> float:
        """Seconds of forward and backward compute since the last :meth:`reset`."""
        return self.forward + self.backward

    def _wrap(self, stage, method: str, kind: str) -> None:
        original = getattr(stage, method)
        device = stage.device

        def timed(chunk, *args, **kwargs):
            _sync(device)
            t0 = time.perf_counter()
            try:
                return original(chunk, *args, **kwargs)
            finally:
                _sync(device)
                self.events.append((kind, int(chunk), t0, time.perf_counter()))

        # On the instance only: other stages and the class stay untouched.
        setattr(stage, method, timed)


def render_timeline(events_by_stage, *, width: int = 64) -> str:
    """A text Gantt chart of pipeline stages: ``F``/``B`` where a stage computes, ``·`` idle.

    Odd micro-batches are drawn in lower case (``FfFf``) so that each one shows.

    ``events_by_stage[i]`` is stage ``i``'s list of ``(kind, micro_batch,
    start, end)``, with times relative to a common start (e.g. each rank's
    step start after a barrier). Example output::

        stage 0 |FFffFFff········BBBBbbbbBBBBbbbb········| busy 60%
        stage 1 |··FFffFFffBBBBbbbbBBBBbbbb··············| busy 62%
    """
    events = [e for stage in events_by_stage for e in stage]
    if not events:
        raise ValueError("no events to draw: run a schedule step with a StageTimer attached")
    t0 = min(e[2] for e in events)
    span = max(e[3] for e in events) - t0 or 1e-9
    lines = []
    for i, stage in enumerate(events_by_stage):
        row = ["·"] * width
        for kind, chunk, start, end in stage:
            a = min(int((start - t0) / span * width), width - 1)
            b = min(max(a + 1, round((end - t0) / span * width)), width)
            row[a:b] = (kind if chunk % 2 == 0 else kind.lower()) * (b - a)
        busy = sum(end - start for _, _, start, end in stage) / span
        lines.append(f"stage {i} |{''.join(row)}| busy {busy:.0%}")
    lines.append(f"{' ' * 8} 0 {'-' * (width - 12)} {span * 1e3:.1f} ms")
    return "\n".join(lines)


def _sync(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without a sync the clock measures the launch only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
