"""Sparse attention (sliding window + global tokens, block-sparse) against dense attention with the same mask.

Every backend must give dense attention's numbers where the mask allows, the
"blocks" backend also its gradients; memory must follow the mask, not seq²;
and a model trained with sparse attention on 2 real gloo ranks (DDP) must end
where one process gets with dense masked attention.

Tolerances: float32. The backends differ from dense SDPA only in the order of
sums (softmax sums and ``p @ v`` over at most 128 allowed keys here, each term
O(1)): at most ~128 × float32 unit roundoff (6e-8) ≈ 8e-6 absolute, within
``assert_close``'s float32 defaults (atol 1e-5, rtol 1.3e-6).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.strategies.measure import peak_bytes
from nbdist.strategies.training.sparse_attention import (
    block_mask,
    block_sparse,
    computed_fraction,
    dense_mask,
    sliding_window,
    sparse_attention,
)


def _qkv(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, t, 8, generator=g).requires_grad_() for _ in range(3)]


def _layout(n):
    # Each query block sees itself, block 0 and every third block before it.
    idx = torch.arange(n)
    return (
        (idx[:, None] == idx[None, :])
        | (idx[None, :] == 0)
        | ((idx[:, None] - idx[None, :]) % 3 == 0)
    )


PATTERNS = {
    "window+global causal": lambda t, bs: sliding_window(20, n_global=3),
    "window both sides": lambda t, bs: sliding_window(10, is_causal=False),
    "block-sparse": lambda t, bs: block_sparse(_layout(-(-t // bs)), bs),
}


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize(("t", "bs"), [(128, 16), (100, 32)])  # 100: a last partial block
def test_backends_equal_dense_attention_with_the_same_mask(name, t, bs):
    mask = block_mask(PATTERNS[name](t, bs), t, block_size=bs)
    assert 0 < computed_fraction(mask) < 1  # some blocks skipped, some computed
    q, k, v = _qkv(t)
    grad_out = torch.randn(2, 3, t, 8, generator=torch.Generator().manual_seed(9))
    want = sparse_attention(q, k, v, mask, backend="dense")
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    got = sparse_attention(q, k, v, mask, backend="blocks")
    torch.testing.assert_close(got, want)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad_out), want_grads):
        torch.testing.assert_close(g, w)
    with torch.no_grad(), warnings.catch_warnings():
        # Eager FlexAttention warns that it materialises the scores (it does; that is fine here).
        warnings.simplefilter("ignore", UserWarning)
        torch.testing.assert_close(sparse_attention(q, k, v, mask, backend="flex_eager"), want)
    # The dense reference really is masked: a masked-out key does not change the output.
    allowed = dense_mask(mask, t)
    qi, ki = (~allowed).nonzero()[0].tolist()
    v2 = v.detach().clone()
    v2[:, :, ki] += 100.0
    moved = sparse_attention(q.detach(), k.detach(), v2, mask, backend="dense")
    torch.testing.assert_close(moved[:, :, qi], want.detach()[:, :, qi])


def test_flex_backend_refuses_backward_on_cpu_and_says_what_to_use():
    q, k, v = _qkv(64)
    mask = block_mask(sliding_window(8), 64, block_size=16)
    with pytest.raises(ValueError, match=r"no backward on CPU.*backend='blocks'"):
        sparse_attention(q, k, v, mask, backend="flex")
    with pytest.raises(ValueError, match=r"built for \(64, 64\).*q has 32 and k 32"):
        sparse_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], mask)
    with pytest.raises(TypeError, match="mask must be a BlockMask"):
        sparse_attention(q, k, v, torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_attention(q, k, v, mask, backend="sparse")


def test_blocks_memory_follows_the_mask_while_dense_grows_with_the_square():
    peaks = {}
    for t in (1024, 2048):
        mask = block_mask(sliding_window(64, n_global=8), t, block_size=64)
        q, k, v = (x.detach() for x in _qkv(t))
        for backend in ("dense", "blocks"):
            with torch.no_grad():
                peaks[backend, t] = peak_bytes(
                    lambda q=q, k=k, v=v, m=mask, b=backend: sparse_attention(q, k, v, m, backend=b)
                )
    # Doubling the sequence: dense attention's scores grow 4x, the window's blocks 2x.
    assert peaks["dense", 2048] > 3.5 * peaks["dense", 1024], peaks
    assert peaks["blocks", 2048] < 2.5 * peaks["blocks", 1024], peaks
    assert peaks["blocks", 2048] < peaks["dense", 2048] / 2, peaks


COMMON = """
import torch
import torch.nn.functional as F
from torch import nn
from nbdist.strategies.training.sparse_attention import block_mask, sliding_window, sparse_attention

class Net(nn.Module):
    def __init__(self, vocab=16, d=16, heads=2):
        super().__init__()
        self.heads, self.tok = heads, nn.Embedding(vocab, d)
        self.qkv, self.o, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, vocab)
    def forward(self, idx, mask, backend):
        B, T = idx.shape
        x = self.tok(idx)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = sparse_attention(q, k, v, mask, backend=backend).transpose(1, 2).reshape(B, T, -1)
        return self.head(x + self.o(y))

def make_net():
    torch.manual_seed(0)
    return Net()

def make_data(n=8, t=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(16, (n, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]

MASK = block_mask(sliding_window(12, n_global=2), 64, block_size=16)
"""
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks
STEPS, LR = 3, 0.5


def test_ddp_training_with_sparse_attention_matches_one_process_with_dense_masked_attention():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        s.run(
            COMMON
            + f"""
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(make_net())
X, Y = make_data()
opt = torch.optim.SGD(model.parameters(), lr={LR})
for _ in range({STEPS}):
    opt.zero_grad()
    logits = model(X[rank::2], MASK, "blocks")
    F.cross_entropy(logits.flatten(0, 1), Y[rank::2].flatten()).backward()
    opt.step()
state = {{k: v.detach() for k, v in model.module.state_dict().items()}}
""",
            sink=ListSink(),
        )
        states = s.pull("state")
    net = make_net()  # noqa: F821 - from COMMON
    X, Y = make_data()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(
            F.cross_entropy(net(X[r::2], MASK, "dense").flatten(0, 1), Y[r::2].flatten())  # noqa: F821
            for r in range(2)
        )
        (loss / 2).backward()
        opt.step()
    want = net.state_dict()
    for r, state in enumerate(states):
        for name, value in state.items():
            torch.testing.assert_close(
                value, want[name], msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}"
            )
    # Training moved the weights: the comparison is not between untouched copies.
    assert not torch.equal(want["qkv.weight"], make_net().qkv.weight)  # noqa: F821
