"""Tensors are read as float64 at the flush, as exact as a CPU tensor's ``item()``.

The flush stacks a batch's tensors per device (:func:`nbdist.metrics.batch.to_columns`):
CPU tensors take the same path as CUDA ones there, so it is tested on the CPU. (Through
``nbdist.log`` a one-element CPU tensor is read with ``item()`` at the call instead.)
"""

from __future__ import annotations

import torch

from nbdist.metrics.batch import Points, to_columns

BIG = 16_777_217  # 2**24 + 1: no float32
DIGITS = 0.1234567890123  # more digits than a float32 holds


def _batch(rows: list[dict]) -> Points:
    points = Points()
    for i, values in enumerate(rows):
        points.steps.append(i)
        points.times.append(1_700_000_000.0 + i)
        for key, value in values.items():
            points.cols.setdefault(key, []).append(value)
    points.n = len(rows)
    return points


def test_tensors_of_one_dtype_arrive_exact():
    counts = [torch.tensor(BIG), torch.tensor(2**53 - 1)]
    _, _, columns = to_columns(_batch([{"count": c} for c in counts]), {})
    assert columns["count"][1].tolist() == [float(BIG), float(2**53 - 1)]


def test_tensors_of_mixed_dtypes_arrive_exact():
    # int64 stacked with float32 promotes to float32: each must be read as itself.
    rows = [
        {
            "count": torch.tensor(BIG),
            "x": torch.tensor(DIGITS, dtype=torch.float64),
            "loss": torch.tensor(0.1, dtype=torch.float32),
        }
    ]
    _, _, columns = to_columns(_batch(rows), {})
    assert columns["count"][1].tolist() == [float(BIG)]
    assert columns["x"][1].tolist() == [DIGITS]
    # A float32 value is what item() gives of it: its own float32, widened exactly.
    assert columns["loss"][1].tolist() == [torch.tensor(0.1).item()]
