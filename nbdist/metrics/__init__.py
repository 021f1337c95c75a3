"""Both sides: per-rank metrics, ``nbdist.log`` on the ranks, a collector in the kernel, a run history on disk.

The FLOP helpers for MFU live here (:mod:`nbdist.metrics.flops`)::

    from nbdist.metrics import flops_per_step, device_peak
    mfu = flops_per_step(model, batch) / step_seconds / (device_peak().tflops * 1e12)

They are imported when first used: the Jupyter server reads the run history through
this package and never needs torch.
"""

from __future__ import annotations

__all__ = ["device_peak", "flops_per_step", "set_peak", "transformer_flops"]

_FLOPS = frozenset(__all__)


def __getattr__(name: str):
    """The FLOP helpers of :mod:`nbdist.metrics.flops`, imported when first used."""
    if name in _FLOPS:
        from nbdist.metrics import flops

        return getattr(flops, name)
    raise AttributeError(f"module 'nbdist.metrics' has no attribute {name!r}")
