"""Rank side: ``NBDIST_GPU_LIKE=1`` makes CPU ranks take two code paths GPU ranks take (for tests).

Two conditions of GPU ranks hid bugs from every CPU test until a GPU ran them:

- torch's optimizers pick their *foreach* kernels by default when every
  parameter is a CUDA tensor (on CPU they loop per tensor), and those kernels
  refuse a parameter list that mixes DTensors with plain tensors (a model
  half-converted by tensor parallel failed at ``opt.step()`` on an H200);
- on a gloo group with CUDA tensors (ranks sharing a GPU) nbdist stages every
  point-to-point call through host memory (:mod:`nbdist.engine.p2p_staging`),
  and a receive into a leaf that requires grad failed there (pipelines).

With ``NBDIST_GPU_LIKE=1`` in the environment the ranks start with, each rank
of a CPU group does both: :func:`install` registers a global optimizer step
pre-hook that sets ``foreach=True`` in every parameter group that left the
choice to torch (``foreach=None``, not fused, not differentiable), as CUDA
would, and :mod:`nbdist.engine.patches` stages CPU tensors' point-to-point
calls. Nothing else changes; without the variable nothing of this is installed.
``bash scripts/test.sh --gpu-like`` runs the CPU strategy tests this way.
"""

from __future__ import annotations

import os

__all__ = ["ENV", "foreach_forced", "install", "requested"]

# The switch, read on the rank when its group forms (the ranks inherit the kernel's environment).
ENV = "NBDIST_GPU_LIKE"

_installed = False


def requested() -> bool:
    """Whether this rank's environment asks for GPU-like code paths (``NBDIST_GPU_LIKE=1``)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV}={os.environ[ENV]!r}: set it to 1 (GPU-like code paths) or 0 (off)")


def foreach_forced() -> bool:
    """Whether optimizers on this rank are made to use foreach kernels (:func:`install` ran)."""
    return _installed


def _foreach_as_on_cuda(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        # Only where torch would choose: an explicit foreach/fused/differentiable stays as given.
        if "foreach" in group and group["foreach"] is None:
            if not group.get("fused") and not group.get("differentiable"):
                group["foreach"] = True
    return None


def install() -> None:
    """Make every optimizer on this rank step with foreach kernels where torch would choose (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_foreach_as_on_cuda)
    _installed = True
