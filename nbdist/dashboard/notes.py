"""Kernel side: lines under the dashboard's table about a figure that cannot be right as logged.

An MFU above 1 says a step did more floating-point work per second than the
device's peak: the peak MFU is divided by is too low, or ``flops=`` counts more
than the step did. The usual cause is mixed precision: the peak follows torch's
default dtype (float32), so a model trained under bf16 or fp16 autocast is
measured against the float32 peak, which on a datacenter GPU is a tenth or less
of the bf16 one. ``nbdist.log`` cannot see autocast itself (it is called after the
autocast block), so the dashboard says it once the figures prove it.

Example::

    >>> from nbdist.metrics.run import Run
    >>> run = Run(1, world_size=2)
    >>> run.add(1, [(0, 1.0, {"mfu": 0.4}), (1, 2.0, {"mfu": 3.2})])
    2
    >>> note_lines(run)[0][:47]
    'mfu above 1 (3.2 on rank 1, latest steps): the '
"""

from __future__ import annotations

__all__ = ["note_lines"]


def note_lines(run) -> list[str]:
    """One line per figure that cannot be right (an MFU above 1 in a rank's latest steps:
    the line goes once a later batch is within the peak); empty when none."""
    above = getattr(run, "mfu_above_1", None)
    if above is None:
        return []
    rank, value = above
    return [
        f"mfu above 1 ({value:.3g} on rank {rank}, latest steps): the steps did more FLOP/s "
        "than the peak it is divided by. A GPU's peak is for torch's default dtype (float32) "
        "unless set_peak(dtype=...) says otherwise: training in bf16 or fp16, call "
        "nbdist.metrics.set_peak(dtype=torch.bfloat16) on the ranks; or give the peak, "
        "set_peak(tflops=...), where it was measured low; else flops= counts more than a "
        "step does"
    ]
