"""How a debugger on a rank shows tensors (nbdist.engine.tensor_view.describe), on real tensors."""

from __future__ import annotations

import torch

from nbdist.engine.tensor_view import SMALL, describe


def test_a_small_tensor_shows_shape_dtype_device_and_values():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert describe(t) == "(2, 3) float32 cpu [[0., 1., 2.], [3., 4., 5.]]"


def test_a_large_tensor_shows_no_values():
    t = torch.zeros(SMALL + 1, dtype=torch.float16)
    assert describe(t) == f"({SMALL + 1},) float16 cpu"


def test_scalars_integers_and_parameters():
    assert describe(torch.tensor(3.5)) == "() float32 cpu 3.5000"
    assert describe(torch.arange(3)) == "(3,) int64 cpu [0, 1, 2]"
    assert describe(torch.nn.Parameter(torch.ones(2))) == "(2,) float32 cpu requires_grad [1., 1.]"


def test_a_meta_tensor_has_no_values_to_show():
    assert describe(torch.ones(2, 2, device="meta")) == "(2, 2) float32 meta"
