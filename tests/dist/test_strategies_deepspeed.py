"""DeepSpeed ZeRO 1/2/3 on real engines (2 ranks, gloo, DeepSpeed's CPU accelerator).

Each stage must train to the parameters one process gets with the same torch
optimizer on the whole batch, while each rank keeps only its share of what the
stage partitions (optimizer state; for stage 3 the parameters as well).

DeepSpeed's config default clips the global gradient norm at 1.0 (0.19.8);
torch optimizers do not clip. That default once made every stage end 1.7e-3
from the reference (a step of 0.77 lr * g where the gradient norm was 1.3), so
``apply_deepspeed`` passes ``gradient_clipping=0`` unless asked, and the
clipping test checks both settings against ``clip_grad_norm_``.

References are computed in one process on a rank (same CPU kernels, one
thread), as the mean over the ranks' half-batches of the loss.
"""

from __future__ import annotations

import pytest
import torch
from ranks_with import ranks_with

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from nbdist.strategies.parallel.deepspeed_zero import deepspeed_available

_REASON = deepspeed_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"DeepSpeed not importable: {_REASON}")

COMMON = """
import torch
from torch import nn

def make_net(seed=0, d=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, 1))

def make_data(n=16, d=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)

def reference(optimizer_class, kwargs, steps, lr, clip=0.0):
    # One process, the full batch: the mean of the 2 ranks' half-batch losses.
    net = make_net()
    X, Y = make_data()
    opt = optimizer_class(net.parameters(), lr=lr, **kwargs)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(net(X[r::2]), Y[r::2]) for r in range(2)) / 2
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip or float("inf"))))
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}, norms

def train_deepspeed(stage, optimizer_class, kwargs, steps, lr, **ds_kwargs):
    import deepspeed
    from nbdist.strategies.parallel.deepspeed_zero import apply_deepspeed, held_bytes
    X, Y = make_data()
    engine, opt = apply_deepspeed(
        make_net(), stage=stage, lr=lr, micro_batch_size=8,
        optimizer_class=optimizer_class, optimizer_kwargs=kwargs, **ds_kwargs,
    )
    for _ in range(steps):
        loss = nn.functional.mse_loss(engine(X[rank::2]), Y[rank::2])
        engine.backward(loss)  # DeepSpeed averages the gradients over the 2 ranks
        engine.step()
    held = held_bytes(engine)
    params = list(engine.module.parameters())
    # Stage 3 keeps a 1/world_size slice of each parameter (ds_tensor); others keep all of it.
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
    with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    # The optimizer state this rank holds: one entry per (flat partition of) parameter.
    inner = getattr(opt, "optimizer", opt)
    state_numel = {
        key: sum(s[key].numel() for s in inner.state.values())
        for key in ("exp_avg", "exp_avg_sq", "momentum_buffer")
        if any(key in s for s in inner.state.values())
    }
    return state, local, state_numel, held
"""
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks, for make_net below
STEPS = 3


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(2, COMMON)


def _assert_states_close(got_per_rank, want, *, rtol, atol):
    for state in got_per_rank:
        assert state.keys() == want.keys()
        for name, value in state.items():
            torch.testing.assert_close(
                value, want[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_one_process_adam(session, stage):
    session.run(
        f"""
state, local_numel, state_numel, held = train_deepspeed({stage}, torch.optim.Adam, {{}}, {STEPS}, 0.01)
full_numel = sum(p.numel() for p in make_net().parameters())
if rank == 0:
    want, _ = reference(torch.optim.Adam, {{}}, {STEPS}, 0.01)
""",
        sink=ListSink(),
    )
    want = session.pull("want", rank=0)
    # With 2 ranks each averaged gradient is (g0 + g1) / 2: one rounding of a commutative
    # sum and an exact halving, the float32 value the reference's backward of (l0 + l1) / 2
    # gives. So Adam sees the same gradients; only the order of its element-wise ops on
    # DeepSpeed's flat partition may differ: a few ulps (u = 6e-8) of a step bounded by
    # lr * (1 - b1) / sqrt(1 - b2) = 0.032, times 3 steps, ~2e-8 (measured: 0, bitwise
    # equal); plus one rounding of |param| < 2: atol 1e-7, rtol 2u. A reduction over more
    # ranks would change gradients by ulps that Adam amplifies where a gradient is near 0.
    _assert_states_close(session.pull("state"), want, rtol=1.2e-7, atol=1e-7)
    full = session.pull("full_numel")[0]
    exp_avg = [n["exp_avg"] for n in session.pull("state_numel")]
    local = session.pull("local_numel")
    if stage < 3:
        # Between steps the gradients are freed: held_bytes finds the weights (all of them
        # below stage 3), Adam's two moments and, under ZeRO, the fp32 master partition (as
        # many elements as a moment), in float32, plus scalars: Adam's step count per tensor
        # it steps (4 B each) and a few DeepSpeed flags (measured: 16 B and 20 B). Not the
        # data in the rank's namespace (576 B) nor gradients (644 B). Stage 3 adds buffers
        # sized by DeepSpeed's defaults.
        master = exp_avg if stage else [0, 0]
        big = [4 * (full + 2 * m + p) for m, p in zip(exp_avg, master)]
        held = session.pull("held")
        assert all(0 <= h - b < 64 for h, b in zip(held, big)), (held, big)
    if stage == 0:  # no partitioning: every rank holds all the state
        assert exp_avg == [full, full] and local == [full, full], (exp_avg, local, full)
        return
    # ZeRO (any stage) partitions the flat fp32 state: each rank has Adam's moments for its
    # half of the parameters (the flat buffer may be padded to split evenly: >=, not ==).
    assert all(0 < n < full for n in exp_avg) and sum(exp_avg) >= full, (exp_avg, full)
    if stage == 3:
        assert all(n < full for n in local) and sum(local) >= full, (local, full)
    else:
        assert local == [full, full], (local, full)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_gradient_clipping_is_off_unless_asked_and_matches_clip_grad_norm(session, clip):
    kwargs = "" if clip is None else f", gradient_clipping={clip}"
    session.run(
        f"""
sgd = {{"momentum": 0.9}}
state, _, _, _ = train_deepspeed(2, torch.optim.SGD, sgd, {STEPS}, 0.01{kwargs})
if rank == 0:
    want, norms = reference(torch.optim.SGD, sgd, {STEPS}, 0.01, clip={clip or 0.0})
    other, _ = reference(torch.optim.SGD, sgd, {STEPS}, 0.01, clip={0.0 if clip else 1.0})
    apart = max(float((want[k] - other[k]).abs().max()) for k in want)
""",
        sink=ListSink(),
    )
    norms, apart = session.pull("norms", rank=0), session.pull("apart", rank=0)
    # Every step's gradient norm exceeds both 0.5 and DeepSpeed's own default of 1.0, so
    # clipping (asked for, or DeepSpeed's default slipping through) changes every step:
    # the reference with the other setting ends far outside the tolerance below.
    assert min(norms) > 1.0 and apart > 1e-4, (norms, apart)
    # SGD is linear in the gradient. The only difference is the norm: DeepSpeed sums
    # squares per partition, torch per tensor, a different order over 161 elements:
    # relative error <= 161 u = 1e-5 in the clip factor. Parameters move at most
    # lr * 0.5 * (1 + 1.9 + 2.71) = 0.028 in 3 momentum steps, so 3e-7, plus one
    # rounding of |param| < 2 (1.2e-7): atol 1e-6.
    _assert_states_close(session.pull("state"), session.pull("want", rank=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("stage=4, lr=0.1", "stage must be 0, 1, 2 or 3.*got 4"),
        (
            "stage=1, lr=0.1, gradient_clipping=-1",
            "gradient_clipping must be a number >= 0.*got -1",
        ),
        ("stage=0, lr=0.1, offload_optimizer=True", "offload_optimizer=True needs stage >= 1"),
    ],
)
def test_bad_arguments_are_refused_with_the_value(session, call, message):
    with pytest.raises(RankError, match=message):
        session.run(
            "from nbdist.strategies.parallel.deepspeed_zero import apply_deepspeed\n"
            f"apply_deepspeed(make_net(), {call})",
            sink=ListSink(),
        )


def test_refuses_outside_a_process_group():
    from nbdist.strategies.parallel.deepspeed_zero import apply_deepspeed

    with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
        apply_deepspeed(make_net(), stage=1, lr=0.1)  # noqa: F821 - from COMMON


def test_first_use_builds_no_cpp_extension_and_opens_no_shared_memory():
    """DeepSpeed's CPU backend would build its shared-memory all-reduce on first use (a C++
    compiler, Python's headers and OpenMP needed, about a minute, "... built successfully"
    under the cell) and open shared-memory segments between the ranks, for an all-reduce
    that only DeepSpeed's inference uses. Fresh ranks, so this is their first use."""
    ranks = ranks_with(2, COMMON)
    fresh = next(ranks)
    try:
        sink = ListSink()
        fresh.run(
            "train_deepspeed(1, torch.optim.Adam, {}, 1, 0.01)\n"
            "import deepspeed.comm.comm as ds_comm\n"
            "shm_op = ds_comm.cdb.shm_comm_op\n",
            sink=sink,
        )
        assert fresh.pull("shm_op") == [None, None]
        text = "\n".join(e[3] for e in sink.events if e[0] == "line")
        assert "built successfully" not in text and "shm" not in text, text
    finally:
        ranks.close()
