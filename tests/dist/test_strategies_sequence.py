"""Sequence parallel (Megatron style) and context parallel (ring attention) on 4 real gloo ranks.

Both split the sequence over the ranks; both must compute what one process
computes on the whole sequence: the same outputs, gradients and trained
parameters. Sequence parallel must also save for backward exactly the
LayerNorm activations it shards, and context parallel must leave its buffers
whole again after the block.

Tolerances: float32, and the distributed runs differ from the reference only
in the order of sums (partial matmuls reduced across ranks; a softmax merged
block by block). The longest sums here have 64 terms of size O(1), so the
reordering error is at most ~64 × float32 unit roundoff (6e-8) ≈ 4e-6:
``assert_close``'s float32 defaults (atol 1e-5, rtol 1.3e-6) hold it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

# pytest puts this test directory on sys.path (no __init__.py here).
from ranks_with import ranks_with
from tiny_transformer import TRANSFORMER_BLOCKS

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError

COMMON = (
    TRANSFORMER_BLOCKS
    + """

class GPT(nn.Module):
    def __init__(self, vocab=32, d=16, heads=4, t=16, n_blocks=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(n_blocks)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
    def forward(self, idx, pos=None):
        # pos: the positions of idx's tokens in the full sequence (context parallel passes its slice's).
        pos = torch.arange(idx.shape[1], device=idx.device) if pos is None else pos
        return self.head(self.norm(self.blocks(self.tok(idx) + self.pos(pos))))

def make_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(**kw)

def make_tokens(n=4, t=16, vocab=32):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(vocab, (n, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]

def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())

SP = dict(blocks=Block, colwise=["attn.q", "attn.k", "attn.v", "mlp.up"],
          rowwise=["attn.o", "mlp.down"], norms=["norm1", "norm2"], gather=["attn", "mlp"])
"""
)
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks
STEPS, LR = 3, 0.1


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(4, COMMON)


def _train_reference():
    net = make_gpt()  # noqa: F821 - from COMMON
    X, Y = make_tokens()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = lm_loss(net(X), Y)  # noqa: F821
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net, torch.tensor(losses)


def _assert_same(state, net, who):
    want = net.state_dict()
    assert state.keys() == want.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, want[name], msg=lambda m, n=name: f"{who} {n}: {m}")


def test_sequence_parallel_trains_like_one_process(session):
    session.run(
        f"""
from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel
from nbdist.strategies.parallel.tensor_parallel import device_mesh
model = apply_sequence_parallel(make_gpt(), device_mesh(), **SP)
X, Y = make_tokens()
with torch.no_grad():
    first_out = model(X)
opt = torch.optim.SGD(model.parameters(), lr={LR})
losses = []
for _ in range({STEPS}):
    opt.zero_grad()
    loss = lm_loss(model(X), Y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
norm_local = tuple(model.blocks[0].norm1.weight.to_local().shape)
state = {{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach()
          for k, v in model.state_dict().items()}}
""",
        sink=ListSink(),
    )
    X, _ = make_tokens()  # noqa: F821
    with torch.no_grad():
        want_out = make_gpt()(X)  # noqa: F821
    for out in session.pull("first_out"):
        torch.testing.assert_close(out, want_out)  # the model's output is whole on every rank
    net, want_losses = _train_reference()
    for r, (state, losses) in enumerate(zip(session.pull("state"), session.pull("losses"))):
        _assert_same(state, net, f"rank {r}")
        torch.testing.assert_close(torch.tensor(losses), want_losses)
    # LayerNorm weights stay whole (replicated) on every rank: they are tiny.
    assert session.pull("norm_local") == [(16,)] * 4


def test_sequence_parallel_norm_gradients_are_whole_on_every_rank_after_backward(session):
    """A norm runs on this rank's sequence shard, so its weight's gradient is a partial sum
    until reduced. It is reduced in backward: the optimizer, and anyone reading ``.grad``,
    gets the whole gradient on every rank (torch 2.11's SGD with momentum on a GPU took the
    partial one wrongly: example 27 parted from the one-process model from its second step)."""
    session.run(
        """
from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel
from nbdist.strategies.parallel.tensor_parallel import device_mesh
model = apply_sequence_parallel(make_gpt(), device_mesh(), **SP)
X, Y = make_tokens()
lm_loss(model(X), Y).backward()
grad = model.blocks[0].norm1.weight.grad
norm_grad = ([type(p).__name__ for p in grad.placements], grad.to_local().clone())
""",
        sink=ListSink(),
    )
    net = make_gpt()  # noqa: F821
    X, Y = make_tokens()  # noqa: F821
    lm_loss(net(X), Y).backward()  # noqa: F821
    for r, (placements, local) in enumerate(session.pull("norm_grad")):
        assert placements == ["Replicate"], f"rank {r}"
        torch.testing.assert_close(local, net.blocks[0].norm1.weight.grad, msg=f"rank {r}")


def test_a_sequence_parallel_norm_in_apply_tp_s_plan_gets_its_whole_gradient(session):
    """A user's own ``plan={...: SequenceParallel()}`` through :func:`apply_tp`: the norm runs on
    each rank's sequence shard, and its weight's gradient is the whole sum on every rank after
    backward, as with :func:`apply_sequence_parallel` (a partial one would meet torch 2.11's
    foreach SGD with momentum as example 27's did)."""
    session.run(
        """
from torch.distributed.tensor.parallel import SequenceParallel
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
torch.manual_seed(0)
full = torch.randn(2, 8, 16, dtype=torch.float64)  # (batch, sequence, hidden), the same on all
norm = nn.Sequential(nn.LayerNorm(16, dtype=torch.float64))
with torch.no_grad():
    norm[0].weight.copy_(torch.linspace(0.5, 1.5, 16))
apply_tp(norm, device_mesh(), plan={"0": SequenceParallel()})
# SequenceParallel takes a plain input as this rank's shard of the sequence.
out = norm(full.tensor_split(world_size, dim=1)[rank])
(out.to_local() ** 2).sum().backward()
grad = norm[0].weight.grad
sp_norm_grad = ([type(p).__name__ for p in grad.placements], grad.to_local().clone())
""",
        sink=ListSink(),
    )
    torch.manual_seed(0)
    full = torch.randn(2, 8, 16, dtype=torch.float64)
    norm = torch.nn.LayerNorm(16, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    (norm(full) ** 2).sum().backward()
    for r, (placements, local) in enumerate(session.pull("sp_norm_grad")):
        assert placements == ["Replicate"], f"rank {r}: {placements}"
        # float64: four partial sums against one, within a few ulps of the sum.
        torch.testing.assert_close(local, norm.weight.grad, rtol=1e-12, atol=1e-12, msg=f"rank {r}")


def test_tensor_and_sequence_parallel_gpts_train_with_foreach_optimizers(session):
    """Both GPTs train like one process with ``foreach=True``, what torch's optimizers use
    on CUDA by default.

    Their foreach kernels refuse a parameter list mixing DTensors with plain tensors;
    the embeddings, final norm and head, outside the sharded blocks, were plain and
    examples 11 and 27 failed at their first ``opt.step()`` on an H200. Now every
    parameter is a DTensor (the rest replicated). Tolerances as in the module docstring.
    """
    session.run(
        f"""
import warnings
from torch.distributed.tensor import DTensor
from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
names = [f"blocks.{{i}}.{{n}}" for i in range(2) for n in SP["colwise"] + SP["rowwise"]]
X, Y = make_tokens()
foreach_states, foreach_losses, plain_params, caught = {{}}, {{}}, {{}}, []
for kind in ("tp", "sp"):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if kind == "tp":
            model = apply_tp(make_gpt(), device_mesh(), colwise=names[0:4] + names[6:10],
                             rowwise=names[4:6] + names[10:12])
        else:
            model = apply_sequence_parallel(make_gpt(), device_mesh(), **SP)
    caught += [str(x.message) for x in w]
    plain_params[kind] = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    opt = torch.optim.SGD(model.parameters(), lr={LR}, foreach=True)
    foreach_losses[kind] = []
    for _ in range({STEPS}):
        opt.zero_grad()
        loss = lm_loss(model(X), Y)
        assert not isinstance(loss, DTensor)  # the model's output stays a plain tensor
        loss.backward()
        opt.step()
        foreach_losses[kind].append(loss.item())
    foreach_states[kind] = {{k: v.full_tensor().detach() for k, v in model.state_dict().items()}}
""",
        sink=ListSink(),
    )
    net, want_losses = _train_reference()
    assert session.pull("plain_params") == [{"tp": [], "sp": []}] * 4
    assert session.pull("caught") == [[]] * 4
    for r, (states, losses) in enumerate(
        zip(session.pull("foreach_states"), session.pull("foreach_losses"))
    ):
        for kind in ("tp", "sp"):
            _assert_same(states[kind], net, f"rank {r} {kind}")
            torch.testing.assert_close(torch.tensor(losses[kind]), want_losses)


def test_tensor_parallel_names_the_parameters_it_cannot_replicate(session):
    """A parameter of a custom module, and a weight tied between two modules, stay plain
    (replicating them could change the forward or untie the weights): the warning names
    them and the fix, and the tie survives."""
    session.run(
        """
import warnings
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))
    def forward(self, x):
        return x * self.gain
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.scale = nn.Embedding(32, 16), Scale()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.tok.weight
    def forward(self, idx):
        h = self.scale(self.tok(idx))
        return self.head(h + self.down(torch.relu(self.up(h))))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tied = apply_tp(Tied(), device_mesh(), colwise=["up"], rowwise=["down"])
tp_warnings = [str(x.message) for x in w]
still_tied = tied.head.weight is tied.tok.weight
""",
        sink=ListSink(),
    )
    for messages in session.pull("tp_warnings"):
        assert len(messages) == 1, messages
        assert "tok.weight, scale.gain, head.weight stay plain tensors" in messages[0]
        assert "foreach=False" in messages[0]
    assert session.pull("still_tied") == [True] * 4


def test_sequence_parallel_saves_a_quarter_of_the_norm_activations(session):
    session.run(
        """
import copy
from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel, saved_local_bytes
from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh
net = make_gpt()
names = [f"blocks.{i}.{n}" for i in range(2) for n in SP["colwise"] + SP["rowwise"]]
tp = apply_tp(copy.deepcopy(net), device_mesh(), colwise=names[0:4] + names[6:10],
              rowwise=names[4:6] + names[10:12])
sp = apply_sequence_parallel(copy.deepcopy(net), device_mesh(), **SP)
X, _ = make_tokens()
saved = []
for m in (tp, sp):
    with saved_local_bytes(exclude=m.parameters()) as s:
        out = m(X)
    out.sum().backward()
    saved.append(s.bytes)
""",
        sink=ListSink(),
    )
    B, T, D = 4, 16, 16
    # A LayerNorm saves its input (B, T, D) and its mean and 1/std (B, T each), float32.
    # Tensor parallel keeps them whole on every rank; sequence parallel keeps a quarter of
    # the sequence, for the 2 norms of each of the 2 blocks. Nothing else changes.
    per_norm = (B * T * D + 2 * B * T) * 4
    expected_saving = 2 * 2 * per_norm * 3 // 4
    for tp_bytes, sp_bytes in session.pull("saved"):
        assert tp_bytes - sp_bytes == expected_saving, (tp_bytes, sp_bytes, expected_saving)


def test_sequence_parallel_names_a_missing_layer(session):
    with pytest.raises(RankError, match=r"block 'blocks.0' has no submodule 'attn.qq'"):
        session.run(
            "from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel\n"
            "from nbdist.strategies.parallel.tensor_parallel import device_mesh\n"
            "apply_sequence_parallel(make_gpt(), device_mesh(), blocks=Block, colwise=['attn.qq'],"
            " rowwise=['attn.o'], norms=['norm1'])",
            sink=ListSink(),
        )
    with pytest.raises(RankError, match=r"blocks.0.attn is a Attention; norms must be LayerNorm"):
        session.run(
            "from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel\n"
            "from nbdist.strategies.parallel.tensor_parallel import device_mesh\n"
            "apply_sequence_parallel(make_gpt(), device_mesh(), blocks=Block, colwise=['attn.q'],"
            " rowwise=['attn.o'], norms=['attn'])",
            sink=ListSink(),
        )


@pytest.mark.parametrize("load_balance", [False, True])
def test_ring_attention_equals_full_attention_with_gradients(session, load_balance):
    session.run(
        f"""
from nbdist.strategies.parallel.context_parallel import ring_attention, shard_sequence, unshard_sequence
g = torch.Generator().manual_seed(2)
q, k, v, grad_out = (torch.randn(2, 3, 32, 8, generator=g) for _ in range(4))
results = {{}}
for causal in (False, True):
    local = [shard_sequence(t, 2, load_balance={load_balance}).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, causal=causal, load_balance={load_balance})
    out.backward(shard_sequence(grad_out, 2, load_balance={load_balance}))
    results[causal] = [unshard_sequence(t, 2, load_balance={load_balance})
                       for t in (out.detach(), *(x.grad for x in local))]
""",
        sink=ListSink(),
    )
    g = torch.Generator().manual_seed(2)
    q, k, v, grad_out = (torch.randn(2, 3, 32, 8, generator=g) for _ in range(4))
    for causal in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        out.backward(grad_out)
        want = [out.detach(), *(x.grad for x in leaves)]
        for r, results in enumerate(session.pull("results")):
            for name, got, exp in zip(("out", "dq", "dk", "dv"), results[causal], want):
                torch.testing.assert_close(
                    got, exp, msg=lambda m, n=name, r=r, c=causal: f"rank {r} causal={c} {n}: {m}"
                )


def test_ring_attention_over_a_group_of_one_is_full_attention(session):
    """A context-parallel group of one rank (world size 1, or cp = 1 in a mesh) attends over the
    whole sequence; its backward sent the K/V gradients to itself, which gloo refused."""
    session.run(
        """
from nbdist.strategies.parallel.context_parallel import ring_attention
alone = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
g = torch.Generator().manual_seed(3)
q, k, v, grad_out = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(4))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out = ring_attention(*leaves, group=alone[rank], causal=True)
out.backward(grad_out)
single = [out.detach(), *(x.grad for x in leaves)]
""",
        sink=ListSink(),
    )
    g = torch.Generator().manual_seed(3)
    q, k, v, grad_out = (torch.randn(2, 3, 16, 8, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    out.backward(grad_out)
    want = [out.detach(), *(x.grad for x in leaves)]
    for r, got in enumerate(session.pull("single")):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, b, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}")


def test_context_parallel_trains_like_one_process_and_restores_its_buffers(session):
    """The model's own SDPA call becomes ring attention; DDP averages the sequence shards' grads."""
    session.run(
        f"""
from torch.nn.parallel import DistributedDataParallel as DDP
from nbdist.strategies.parallel.context_parallel import context_parallel
model = DDP(make_gpt())
X, Y = make_tokens()
pos = torch.arange(X.shape[1]).unsqueeze(0)
x, y = X.clone(), Y.clone()
opt = torch.optim.SGD(model.parameters(), lr={LR})
losses, local_shapes = [], []
for _ in range({STEPS}):
    opt.zero_grad()
    with context_parallel(buffers=[x, y, pos], seq_dims=[1, 1, 1]):
        local_shapes.append((tuple(x.shape), pos.tolist()))
        loss = lm_loss(model(x, pos[0]), y)
        loss.backward()
    # Each rank's loss is the mean over its quarter of the tokens; the mean over ranks is the whole.
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / world_size)
    opt.step()
restored = torch.equal(x, X) and torch.equal(y, Y) and pos.shape == (1, 16)
state = {{k: v.detach() for k, v in model.module.state_dict().items()}}
""",
        sink=ListSink(),
    )
    net, want_losses = _train_reference()
    for r, (state, losses) in enumerate(zip(session.pull("state"), session.pull("losses"))):
        _assert_same(state, net, f"rank {r}")
        torch.testing.assert_close(torch.tensor(losses), want_losses)
    assert session.pull("restored") == [True] * 4
    # Load balanced: rank r holds chunks r and 7 - r of 8 (2 tokens each) of the 16 positions.
    shapes = session.pull("local_shapes")
    assert shapes[0][0] == ((4, 4), [[0, 1, 14, 15]])
    assert shapes[3][0] == ((4, 4), [[6, 7, 8, 9]])


def test_torch_context_parallel_refuses_cpu_so_the_ring_runs_there(session):
    """Why backend="auto" takes the ring on CPU: torch's own raises (torch 2.13)."""
    session.run(
        """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel as torch_cp
q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
try:
    with torch_cp(init_device_mesh("cpu", (world_size,)), buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch_error = None
except NotImplementedError as e:
    torch_error = str(e)
""",
        sink=ListSink(),
    )
    for e in session.pull("torch_error"):
        assert e and "_scaled_dot_product_flash_attention_for_cpu" in e, e


def test_context_parallel_refuses_what_the_ring_cannot_do(session):
    with pytest.raises(RankError, match=r"drop attn_mask, dropout_p and enable_gqa"):
        session.run(
            "from nbdist.strategies.parallel.context_parallel import ring_sdpa\n"
            "q = torch.randn(1, 1, 4, 8)\n"
            "with ring_sdpa():\n"
            "    F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))",
            sink=ListSink(),
        )
    # Buffers are resized in place: memory shared between two of them, or a strided view,
    # would be overwritten or misplaced.
    for buffers, pattern in (
        ("[tokens[0], tokens[1]]", r"buffer 1 \(shape \(8,\)\) shares memory with buffer 0"),
        ("[tokens[:, :-1]]", r"buffer 0 \(shape \(2, 7\)\) is a strided view.*x\.clone\(\)"),
    ):
        with pytest.raises(RankError, match=pattern):
            session.run(
                "from nbdist.strategies.parallel.context_parallel import context_parallel\n"
                "tokens = torch.zeros(2, 8)\n"
                f"b = {buffers}\n"
                "with context_parallel(buffers=b, seq_dims=[b[0].dim() - 1] * len(b)):\n"
                "    pass",
                sink=ListSink(),
            )
    with pytest.raises(RankError, match=r"sequence length 12 is not divisible by 8; pad it to 16"):
        session.run(
            "from nbdist.strategies.parallel.context_parallel import context_parallel\n"
            "x = torch.zeros(1, 12)\n"
            "with context_parallel(buffers=[x], seq_dims=[1]):\n"
            "    pass",
            sink=ListSink(),
        )
