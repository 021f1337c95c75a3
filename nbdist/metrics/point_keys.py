"""Both sides (rank and kernel): the keys nbdist gives a point itself, and what each means.

The rank works these out when ``nbdist.log`` is called and refuses a user's value
under one of them (:mod:`nbdist.metrics.batch`); the kernel shows them after the
user's own keys, and tables leave them out of the per-key columns
(:mod:`nbdist.metrics.run`, :mod:`nbdist.dashboard.table`). They are listed once
here because a key added on one side only would go wrong quietly: a derived key
the rank did not reserve lets a user's value replace nbdist's on some points.
"""

from __future__ import annotations

from nbdist.metrics.gpu import GPU_KEYS
from nbdist.metrics.steptime import BREAKDOWN_KEYS, MEMORY_KEYS

__all__ = ["DERIVED_KEYS", "WORKED_OUT"]

_RATES = {
    "step_time": "the seconds since the rank's previous point",
    "samples_per_s": "samples= over the step time",
    "tokens_per_s": "tokens= over the step time",
    "tflops": "flops= over the step time",
    "mfu": "tflops over the device's peak",
}
_BREAKDOWN = {
    "compute_s": "the step's other seconds",
    "comm_s": "the step's seconds in collectives",
    "data_s": "the step's seconds waiting for data",
}
# Every key nbdist works out for a point, with what it means (a breakdown key of
# steptime's without a meaning here fails at import).
WORKED_OUT = {
    **_RATES,
    **{key: _BREAKDOWN[key] for key in BREAKDOWN_KEYS},
    **dict.fromkeys(MEMORY_KEYS, "the rank's memory, read by nbdist"),
    **dict.fromkeys(GPU_KEYS, "the rank's GPU, read through NVML"),
}
# The keys with a meaning to nbdist, in the order tables and to_pandas() show them after
# the user's own. ``data_time`` is among them but not worked out: a user's own
# data-loading seconds are meant to replace the data timer's, so it may be logged.
DERIVED_KEYS = (*_RATES, *BREAKDOWN_KEYS, "data_time", *MEMORY_KEYS, *GPU_KEYS)
