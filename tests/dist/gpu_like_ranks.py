"""Two CPU ranks with or without ``NBDIST_GPU_LIKE=1`` (the tests of the GPU-like code paths)."""

from __future__ import annotations

import nbdist
from nbdist.engine.gpu_like import ENV


def two_cpu_ranks(gpu_like: bool, monkeypatch) -> nbdist.DistSession:
    """A session of 2 CPU ranks (not started: use it in ``with``) whose environment has
    ``NBDIST_GPU_LIKE=1`` when ``gpu_like``, else no such variable."""
    if gpu_like:
        monkeypatch.setenv(ENV, "1")
    else:
        monkeypatch.delenv(ENV, raising=False)
    return nbdist.DistSession(2, cpu=True, timeout=120, history=False)
