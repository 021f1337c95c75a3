"""Pure logic of compressed communication: sign packing, 1-bit error feedback, byte counting."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nbdist.strategies.optim.compression import CommCounter, apply_comm_hook, dense_bytes
from nbdist.strategies.optim.onebit_adam import onebit_compress, pack_signs, unpack_signs


def test_signs_pack_eight_to_a_byte_and_come_back():
    x = torch.tensor([1.0, -1, 0, 3, -0.5, -2, -7, 2, -1, -1, -1, -1, -1, -1, -1, 5])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0b10110001, 0b00000001]
    # Zero counts as positive: every number decodes to exactly +1 or -1.
    assert unpack_signs(packed).tolist() == [1.0 if v >= 0 else -1.0 for v in x.tolist()]


def test_pack_signs_names_a_bad_length():
    with pytest.raises(ValueError, match="divisible by 8, got 5"):
        pack_signs(torch.zeros(5))


def test_onebit_compress_keeps_the_norm_and_delays_what_it_drops():
    g = torch.Generator().manual_seed(0)
    error = torch.zeros(40)
    sent = torch.zeros(40)
    inputs = torch.zeros(40)
    for t in range(100):
        x = torch.randn(40, generator=g) * (1 + t % 3)
        before = x + error
        packed, scale = onebit_compress(x, error)
        decoded = scale * unpack_signs(packed)
        # The scale is the RMS of what was compressed: the decoded vector has its L2 norm.
        assert scale.item() == pytest.approx(before.norm().item() / math.sqrt(40), rel=1e-6)
        sent += decoded
        inputs += x
    # Error feedback: all that was sent plus what is still held is all that came in
    # (fp32 sums of 100 terms of size ~3: rounding well under 1e-3).
    torch.testing.assert_close(sent + error, inputs, rtol=0, atol=1e-3)
    # ...and what is held stays of the size of one input, not of the 100 summed.
    assert error.abs().max() < 10


def test_onebit_compress_keeps_padding_at_zero():
    error = torch.zeros(16)
    x = torch.cat([torch.arange(1.0, 11.0), torch.zeros(6)])
    packed, scale = onebit_compress(x, error, valid=10)
    assert scale.item() == pytest.approx(torch.arange(1.0, 11.0).norm().item() / math.sqrt(10))
    assert torch.equal(error[10:], torch.zeros(6))


def test_counter_counts_per_step_and_the_ratio():
    sent = CommCounter()
    assert sent.ratio == 1.0 and sent.take() == 0
    sent.add(100, dense=400)
    sent.add(50, dense=200)
    assert sent.take() == 150 and sent.take() == 0
    sent.add(10)
    assert sent.take() == 10
    assert sent.total == 160 and sent.dense == 610 and sent.calls == 3
    assert "ratio=3.81" in repr(sent)


def test_dense_bytes_counts_trainable_gradients():
    model = nn.Sequential(nn.Linear(10, 4), nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    assert dense_bytes(model) == (40 + 4 + 2) * 4


def test_apply_comm_hook_wants_ddp():
    with pytest.raises(TypeError, match="got Linear.*DistributedDataParallel\\(model\\)"):
        apply_comm_hook(nn.Linear(2, 2), "fp16")
