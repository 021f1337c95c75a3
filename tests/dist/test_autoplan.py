"""autoplan: every dp × tp × pp plan enumerated and estimated, a memory budget applied, the best
few measured on 4 real gloo ranks, the winner trained; and compare running the 2D/3D and
compressed-communication plans.

Tolerances. Every plan computes the same mathematics as one process on the whole batch;
only the order of float32 sums differs (partial matmul products added by all-reduce or
reduce-scatter, micro-batch gradients accumulated). Sums here have at most 64 terms of size
O(1): ~64 × 6e-8 ≈ 4e-6 per gradient entry, times lr 0.1 over 3-5 SGD steps: losses agree
within ``assert_close``'s float32 defaults (atol 1e-5, rtol 1.3e-6). The fp16/bf16 hooks
round each rank's gradient share to 16 bits and the 4-rank all-reduce adds in 16 bits:
~4 roundings, relative error <= 4u per gradient entry (u = 2^-11 fp16, 2^-8 bf16), with a
factor 2 for cancellation between the ranks' shares; to first order that changes the loss
decrease ``L0 - L`` by the same relative amount, so |L_hook - L_ddp| <= 8u (L0 - L) + 1e-5.
"""

from __future__ import annotations

import pytest
import torch

# Defined on the ranks and in this process alike (pytest puts this directory on sys.path).
from ranks_with import ranks_with
from tiny_transformer import TRANSFORMER_BLOCKS
from torch import nn

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from nbdist.strategies.plan.estimate import NotAdmitted, enumerate_plans, model_facts

COMMON = (
    TRANSFORMER_BLOCKS
    + """

def make_gpt(vocab=32, d=16, heads=4, t=8, n_blocks=2):
    return nn.Sequential(Embed(vocab, d, t), *[Block(d, heads) for _ in range(n_blocks)],
                         nn.LayerNorm(d), nn.Linear(d, vocab))

def lm_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())

_tokens = torch.randint(32, (8, 9), generator=torch.Generator().manual_seed(1))
X, Y = _tokens[:, :-1], _tokens[:, 1:]
COLWISE, ROWWISE = ["attn.q", "attn.k", "attn.v", "mlp.up"], ["attn.o", "mlp.down"]
LAYOUT = dict(loss_fn=lm_loss, blocks=Block, colwise=COLWISE, rowwise=ROWWISE)
"""
)
exec(COMMON)  # noqa: S102 - the same definitions as on the ranks
MIB = 2**20
ALL_LAYOUTS = {"ddp4", "zero4", "fsdp4", "fsdp2×tp2", "fsdp2×pp2", "tp4", "tp2×pp2", "pp4"}


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _sharded(name: str) -> bool:
    # No rank holds all parameters: FSDP over dp, or a tensor/pipeline split.
    return not name.startswith(("ddp", "zero"))


def _gpt_facts(optimizer=torch.optim.Adam, n=8):
    return model_facts(
        make_gpt,  # noqa: F821 - from COMMON
        (X[:n], Y[:n]),  # noqa: F821
        optimizer=optimizer,
        **LAYOUT,  # noqa: F821
    )


# -- enumeration and estimates: arithmetic in this process, no engines ----------------------


def test_four_ranks_give_every_layout_with_and_without_checkpointing():
    plans = enumerate_plans(_gpt_facts(), 4)
    names = {p.name for p, _ in plans}
    assert names == ALL_LAYOUTS | {f"{n}+ac" for n in ALL_LAYOUTS}
    assert all(isinstance(est, dict) for _, est in plans), plans
    by = {p.name: est for p, est in plans}
    # 8 samples: pp4 cuts them into 2 × 4 micro-batches; 1F1B's bubble (p-1)/(m+p-1).
    assert by["pp4"]["microbatches"] == 8 and by["pp4"]["bubble"] == pytest.approx(3 / 11)
    # Checkpointing keeps block inputs only: fewer activation bytes, same parameters.
    assert by["fsdp4+ac"]["activations"] < by["fsdp4"]["activations"]
    assert by["fsdp4+ac"]["params"] == by["fsdp4"]["params"]


def test_plans_the_batch_or_model_cannot_take_say_which_number_does_not_fit():
    plans = enumerate_plans(_gpt_facts(n=6), 4)
    reasons = {p.name: str(e) for p, e in plans if isinstance(e, NotAdmitted)}
    assert reasons["ddp4"] == "dp 4 does not divide the global batch (6)"
    assert "6 samples" in reasons["pp4"] and "1F1B needs at least 4" in reasons["pp4"]
    # 6 = 2 replicas of 3, or 3 micro-batches of 2 for two stages: these stay.
    assert {"fsdp2×tp2", "tp2×pp2", "tp4"} <= {p.name for p, e in plans if isinstance(e, dict)}
    # Tensor parallel over 3 ranks cannot split 16-wide layers.
    three = {p.name: e for p, e in enumerate_plans(_gpt_facts(n=6), 3)}
    assert str(three["tp3"]) == "tp 3 does not divide attn.q.out_features (16)"
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        enumerate_plans(_gpt_facts(), 0)


def test_estimates_are_the_byte_arithmetic_of_the_model():
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    est = {p.name: e for p, e in enumerate_plans(model_facts(_mlp, (x, y)), 2)}
    full = (8 * 16 + 16 + 16 * 4 + 4) * 4  # 212 float32 parameters
    # Adam: exp_avg and exp_avg_sq per parameter, plus a float32 step counter per tensor.
    adam = 2 * full + 4 * 4
    assert (est["ddp2"]["params"], est["ddp2"]["grads"]) == (full, full)
    assert est["ddp2"]["optimizer"] == pytest.approx(adam)
    assert est["ddp2"]["transient"] == full  # DDP's gradient buckets
    assert est["zero2"]["optimizer"] == pytest.approx(adam / 2)
    assert est["fsdp2"]["params"] == full / 2 and est["fsdp2"]["comm"] == 3 * full
    # tp2: the first Linear split with its bias, the second's weight split, its bias whole.
    assert est["tp2"]["params"] == ((8 * 16 + 16) / 2 + 16 * 4 / 2 + 4) * 4
    assert est["pp2"]["params"] == (8 * 16 + 16) * 4  # stage 0: the first Linear
    # Saved for backward (12 samples): the input, tanh's output (= the second Linear's input),
    # mse's input and target; each rank of ddp2 holds half of them.
    assert est["ddp2"]["activations"] == (12 * 8 + 12 * 16 + 12 * 4 + 12 * 4) * 4 / 2


def test_the_budget_reads_bytes_or_units_and_names_the_fix():
    from nbdist.strategies.plan.autoplan import parse_bytes

    assert parse_bytes("512 MiB") == 512 * 2**20 and parse_bytes("2GB") == 2e9
    assert parse_bytes(1024) == 1024.0
    with pytest.raises(ValueError, match=r"memory_per_rank='lots': give bytes .* '512 MiB'"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="memory_per_rank=0"):
        parse_bytes(0)


# -- on the ranks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(4, COMMON + "from nbdist.strategies.plan.autoplan import autoplan\n")


def _reference(steps: int) -> list[float]:
    """One process, whole batch, SGD: the loss before each step."""
    torch.manual_seed(0)
    net = make_gpt()  # noqa: F821
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(net(X), Y)  # noqa: F821
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_the_chosen_plan_trains_like_one_process(session):
    session.run(
        """
# foreach=True: what torch's optimizers use on CUDA, where they refuse DTensors mixed with
# plain tensors; every plan must give its optimizer DTensors only (or plain tensors only).
plan = autoplan(make_gpt, (X, Y), world_size=world_size, memory_per_rank="64 MiB",
                optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1, "foreach": True}, top_k=3, steps=3,
                warmup=1, **LAYOUT)
table, best = plan.table, plan.best
losses = [plan.step(X, Y) for _ in range(3)]
""",
        sink=ListSink(),
    )
    want = _reference(4)
    tables = session.pull("table")
    # Measurements are reduced before ranking: every rank chose alike.
    assert all(t == tables[0] for t in tables[1:])
    measured = [r for r in tables[0] if "samples_per_s" in r]
    assert [r["rank"] for r in measured] == [1, 2, 3] and measured[0]["status"] == "chosen"
    assert (
        measured[0]["samples_per_s"] >= measured[1]["samples_per_s"] >= measured[2]["samples_per_s"]
    )
    assert session.pull("best", rank=0)["plan"] == measured[0]["plan"]
    # Each measured plan's last timed step (after warmup 1 + 2 steps) saw the reference's 4th loss.
    for row in measured:
        torch.testing.assert_close(
            torch.tensor(row["loss"], dtype=torch.float32), torch.tensor(want[3])
        )
    # The kernel's view: the chosen plan first, estimate and measurement side by side.
    from nbdist.dashboard.plan_comparison import plans_table

    df = plans_table(tables[0])
    assert df.index[0] == measured[0]["plan"] and df["rank"].iloc[0] == 1
    assert df.loc[measured[0]["plan"], "peak MiB"] == round(measured[0]["peak_mib"], 3)
    assert df["est. MiB"].notna().all() and df["peak MiB"].notna().sum() == 3
    # The applied plan starts afresh and trains like one process.
    for got in session.pull("losses"):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[:3]))


def test_a_budget_below_the_unsharded_plans_keeps_only_sharded_ones(session):
    est = {p.name: e for p, e in enumerate_plans(_gpt_facts(), 4)}
    # Just under the smallest plan that keeps every parameter on every rank.
    budget = min(e["memory"] for n, e in est.items() if not _sharded(n)) - 1
    assert any(e["memory"] <= budget for e in est.values())
    session.push({"budget": budget})
    session.run(
        "plan = autoplan(make_gpt, (X, Y), world_size=world_size, memory_per_rank=budget, "
        "top_k=2, steps=1, warmup=1, **LAYOUT)\ntable = plan.table",
        sink=ListSink(),
    )
    table = session.pull("table", rank=0)
    for row in table:
        if not _sharded(row["plan"]):
            assert row["status"].startswith("over budget: estimated"), row
    kept = [r for r in table if r["status"] in ("chosen", "measured", "fits; not measured")]
    assert kept and all(_sharded(r["plan"]) for r in kept)
    # Estimated, then checked: a measured plan over the budget is marked and never chosen.
    for row in table:
        if "peak_mib" in row:
            over = row["peak_mib"] * MIB > budget
            assert row["status"].startswith("over budget: measured") == over, row
    chosen = next(r for r in table if r["status"] == "chosen")
    assert chosen["peak_mib"] * MIB <= budget


def test_no_plan_fits_a_budget_below_every_estimate(session):
    est = {p.name: e["memory"] for p, e in enumerate_plans(_gpt_facts(), 4)}
    smallest = min(est, key=est.get)
    with pytest.raises(RankError) as info:
        session.run(
            "autoplan(make_gpt, (X, Y), world_size=world_size, memory_per_rank='1 KiB', **LAYOUT)",
            sink=ListSink(),
        )
    message = str(info.value)
    assert "no plan fits memory_per_rank=0.001 MiB" in message
    assert f"smallest estimate is {smallest} at {est[smallest] / MIB:.3f} MiB per rank" in message


def test_a_model_and_batch_no_layout_can_split_name_the_numbers(session):
    # Linear layers 6 wide (tp 4 cannot split them), not an nn.Sequential (no pipeline),
    # 3 samples (no dp of 2 or 4).
    code = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    def forward(self, x):
        return self.body(x)
autoplan(Net, (torch.randn(3, 4), torch.randn(3, 2)), world_size=world_size, memory_per_rank=2**30)
"""
    with pytest.raises(RankError, match=r"no parallel plan suits this model and batch on 4 ranks "):
        session.run(code, sink=ListSink())
    with pytest.raises(RankError, match=r"dp 4 does not divide the global batch \(3\)"):
        session.run(code, sink=ListSink())
    with pytest.raises(RankError, match=r"autoplan\(world_size=2\) but the process group has 4"):
        session.run(
            "autoplan(make_gpt, (X, Y), world_size=2, memory_per_rank=2**30)", sink=ListSink()
        )


def test_compare_runs_the_new_plans_and_their_losses_agree_with_ddp(session):
    session.run(
        """
from nbdist.strategies.plan.compare import compare
def share(step, r):
    return X.tensor_split(world_size)[r], Y.tensor_split(world_size)[r]
kw = dict(steps=2, warmup=1, **LAYOUT)
sgd = compare(make_gpt, share, strategies=("ddp", "fsdp_tp", "3d", "ddp_fp16", "ddp_bf16"),
              optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1, "foreach": True}, **kw)
# Compression held back past the last step: the same Adam as DDP's.
plain = compare(make_gpt, share, strategies=("ddp", "ddp_powersgd", "onebit_adam"),
                compress_after=10, **kw)
squeezed = compare(make_gpt, share, strategies=("ddp", "ddp_powersgd", "onebit_adam"), **kw)
""",
        sink=ListSink(),
    )
    sgd = {r["strategy"]: r for r in session.pull("sgd", rank=0)}
    assert sgd["fsdp_tp"]["layout"] == "dp 2 × tp 2 × pp 1"
    assert sgd["3d"]["layout"] == "dp 1 × tp 2 × pp 2"
    want = _reference(3)  # warmup 1 + 2 timed: the last timed loss is the third
    ddp = sgd["ddp"]["loss"]
    torch.testing.assert_close(torch.tensor(ddp, dtype=torch.float32), torch.tensor(want[2]))
    for name in ("fsdp_tp", "3d"):
        torch.testing.assert_close(sgd[name]["loss"], ddp, rtol=1.3e-6, atol=1e-5)
    decrease = want[0] - want[2]
    for name, u in (("ddp_fp16", 2**-11), ("ddp_bf16", 2**-8)):
        assert abs(sgd[name]["loss"] - ddp) <= 8 * u * decrease + 1e-5, (name, sgd[name], ddp)
        # Half the bytes of DDP's fp32 all-reduce (rows round to 1 KiB).
        assert sgd[name]["comm_mib"][0] == pytest.approx(sgd["ddp"]["comm_mib"][0] / 2, abs=1e-3)
    plain = {r["strategy"]: r for r in session.pull("plain", rank=0)}
    for name in ("ddp_powersgd", "onebit_adam"):
        torch.testing.assert_close(
            plain[name]["loss"], plain["ddp"]["loss"], rtol=1.3e-6, atol=1e-5
        )
    with pytest.raises(
        RankError, match="onebit_adam is Adam with 1-bit momentum, but optimizer=SGD"
    ):
        session.run(
            "compare(make_gpt, share, strategies=('onebit_adam',), optimizer=torch.optim.SGD, **kw)",
            sink=ListSink(),
        )
    squeezed = {r["strategy"]: r for r in session.pull("squeezed", rank=0)}
    dense = squeezed["ddp"]["comm_mib"][0]
    # PowerSGD rank 1 sends n + m numbers per n × m matrix (16 × 16 .. 32 × 16 here: at most
    # 1/8 of them) and the vectors whole (416 of 5664 numbers); 1-bit Adam one bit per number
    # (1/32) plus padding to 32 numbers and scales per tensor: each well under a quarter.
    for name in ("ddp_powersgd", "onebit_adam"):
        assert 0 < squeezed[name]["comm_mib"][0] < dense / 4, (name, squeezed[name], dense)
