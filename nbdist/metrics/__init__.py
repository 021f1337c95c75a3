"""Both sides: per-rank metrics, ``nbdist.log`` on the ranks, a collector in the kernel, a run history on disk."""
