"""nbdist.checkpoint on real engines (2 CPU ranks, gloo): DDP and FSDP2 state survive a restart.

The reference is the same training run without interruption: stopping after a
checkpoint, wiping the model, loading and training on must give the very same
weights (``torch.testing.assert_close``), which needs the optimizer state too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import nbdist
from nbdist.checkpoint import CheckpointError, latest, load, save
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError

# Builds the same model and optimizer on every rank (seeded), wrapped as asked;
# train(k) does k AdamW steps on rank-dependent data; flat() gathers the full weights.
SETUP = """
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

def build(kind):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    if kind == "ddp":
        net = DDP(net)
    else:
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(net)
    return net, torch.optim.AdamW(net.parameters(), lr=0.05)

def train(net, opt, steps, start):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

def flat(net):
    return torch.cat([
        (p.full_tensor() if isinstance(p, DTensor) else p.detach()).reshape(-1)
        for p in net.parameters()
    ])
"""


# Each rank saves its own tensors (its rank, its RNG state), draws, and loads them back.
PER_RANK_TENSORS = """
net, opt = build('ddp')
rng_saved = torch.get_rng_state()
nbdist.checkpoint.save({path!r}, model=net, step=1, mine=torch.tensor([float(rank)]), rng=rng_saved)
torch.rand(5)
info = nbdist.checkpoint.load({path!r}, model=net)
mine, rng_back = info['mine'].item(), bool(torch.equal(info['rng'], rng_saved))
"""


@pytest.fixture(scope="module")
def session():
    s = nbdist.DistSession(2, cpu=True, timeout=120, history=False)
    s.start()
    try:
        s.run(SETUP)
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_save_load_continues_exactly_like_an_uninterrupted_run(session, tmp_path, kind):
    path = str(tmp_path / f"{kind}_step_3")
    session.push({"path": path, "kind": kind})
    session.run(
        "net, opt = build(kind)\n"
        "train(net, opt, 3, 0)\n"
        "saved = nbdist.checkpoint.save(path, model=net, optimizer=opt, step=3, note='x')\n"
        "train(net, opt, 3, 3)\n"
        "reference = flat(net)\n"
        # A fresh model and optimizer, as after %dist_restart; then load and go on.
        "net, opt = build(kind)\n"
        "fresh = flat(net)\n"
        "info = nbdist.checkpoint.load(path, model=net, optimizer=opt)\n"
        "train(net, opt, 3, info['step'])\n"
        "resumed = flat(net)\n"
    )
    assert session.pull("saved") == [path, path]
    assert session.pull("info") == [{"step": 3, "note": "x"}] * 2
    reference, fresh, resumed = (session.pull(n, rank=0) for n in ("reference", "fresh", "resumed"))
    assert not torch.allclose(fresh, reference)  # the wiped model really differed
    torch.testing.assert_close(resumed, reference)
    torch.testing.assert_close(session.pull("resumed", rank=1), reference)
    # Sharded: one data file per rank, the completion marker last.
    files = sorted(os.listdir(path))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "nbdist.json"], files
    with open(os.path.join(path, "nbdist.json")) as f:
        assert json.load(f)["world_size"] == 2


def test_fsdp2_checkpoint_shards_are_written_by_each_rank(session, tmp_path):
    # FSDP2 holds half of every weight per rank: each rank's file carries its half,
    # so neither file is (nearly) the whole model.
    path = str(tmp_path / "fsdp_big")
    session.push({"path": path})
    session.run(
        "big = nn.Linear(256, 256)\nfully_shard(big)\nnbdist.checkpoint.save(path, model=big)\n"
    )
    sizes = [os.path.getsize(os.path.join(path, f"__{r}_0.distcp")) for r in (0, 1)]
    whole = 256 * 257 * 4
    assert all(whole * 0.4 < s < whole * 0.7 for s in sizes), (sizes, whole)


def test_ddp_checkpoint_loads_into_one_process_without_a_group(session, tmp_path):
    path = str(tmp_path / "ddp_for_eval")
    session.push({"path": path})
    session.run(
        "net, opt = build('ddp')\n"
        "train(net, opt, 2, 0)\n"
        "nbdist.checkpoint.save(path, model=net, step=2, lr=0.05, scale=torch.arange(3.0))\n"
        "weights = flat(net)\n"
    )
    # Here, in the test process: no process group, a plain (unwrapped) model.
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    info = load(path, model=plain)
    assert info["step"] == 2 and info["lr"] == 0.05
    torch.testing.assert_close(info["scale"], torch.arange(3.0))
    flat = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    torch.testing.assert_close(flat, session.pull("weights", rank=0))


def test_a_tensor_extra_comes_back_to_the_rank_that_saved_it(session, tmp_path):
    # Before: a key every rank had was written once, rank 0's: rank 1 got rank 0's tensor
    # (a per-rank RNG state restored wrong, without a word).
    path = str(tmp_path / "per_rank")
    session.run(PER_RANK_TENSORS.format(path=path))
    assert session.pull("mine") == [0.0, 1.0]
    assert session.pull("rng_back") == [True, True]
    # One process without a group: rank 0's. More ranks than saved it: the others get None,
    # and a warning; the rest loads.
    assert load(path)["mine"].item() == 0.0
    one = str(tmp_path / "one_process")
    save(one, step=7, mine=torch.tensor([5.0]))
    session.push({"one": one})
    sink = ListSink()
    session.run("back = nbdist.checkpoint.load(one)", sink=sink)
    assert session.pull("back")[0] == {"step": 7, "mine": torch.tensor([5.0])}
    assert session.pull("back")[1] == {"step": 7, "mine": None}
    warned = " ".join(e[3] for e in sink.events if e[0] == "line" and e[2] == "rank 1")
    assert "was saved by 1 rank(s): rank 1 has no mine of its own (None" in warned, sink.events
    # A tensor only some ranks saved: refused on every rank alike, none left waiting.
    session.run(
        "extras = {'best': torch.ones(1)} if rank == 0 else {}\n"
        "nbdist.checkpoint.save(path + '_some', model=net, step=1, **extras)"
    )
    with pytest.raises(RankError) as info:
        session.run("nbdist.checkpoint.load(path + '_some', model=net)")
    assert info.value.ranks == [0, 1]
    assert "holds no tensor 'best' of rank 1 (not every rank saved it)" in str(info.value)


def test_stateful_extras_round_trip(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.step()
        sched.step()
    save(tmp_path / "s", model=model, optimizer=opt, step=3, scheduler=sched)
    opt2 = torch.optim.SGD(model.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    assert load(tmp_path / "s", model=model, optimizer=opt2, scheduler=sched2)["step"] == 3
    assert sched2.last_epoch == 3
    assert opt2.param_groups[0]["lr"] == 0.125


def test_latest_skips_incomplete_checkpoints(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (5, 10, 20):
        save(tmp_path / f"step_{step}", model=model, step=step)
    assert latest(tmp_path) == str(tmp_path / "step_20")
    # A save cut short (a rank died before the marker): skipped, and refused by load.
    os.remove(tmp_path / "step_20" / "nbdist.json")
    assert latest(tmp_path) == str(tmp_path / "step_10")
    with pytest.raises(CheckpointError, match="is incomplete"):
        load(tmp_path / "step_20", model=model)
    assert latest(tmp_path / "nothing_here") is None


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: save(p, optimizer=object()), "optimizer= needs model="),
        (lambda p: save(p), "nothing to save"),
        (lambda p: save(p, step=-1), r"step=-1: give a whole number"),
        (lambda p: save(p, step=2, blob=object()), "extra value blob=object"),
        # Before: saved, and loaded as {'1': 'a'}: info["table"][1] raised KeyError.
        (
            lambda p: save(p, step=2, table={"a": [{1: "x"}]}),
            r"extra value table: its key 1 \(int\) would load as \"1\" .*use string keys",
        ),
        (lambda p: save("", step=1), "checkpoint path ''"),
        (lambda p: load(os.path.join(p, "missing")), "does not exist"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(tmp_path, call, message):
    with pytest.raises(CheckpointError, match=message):
        call(str(tmp_path))


def test_loading_what_was_not_saved_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    save(tmp_path / "m", model=model, step=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="has no optimizer state"):
        load(tmp_path / "m", model=model, optimizer=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    with pytest.raises(CheckpointError, match="has no state for 'scheduler'"):
        load(tmp_path / "m", model=model, scheduler=sched)


def test_a_rank_error_in_save_names_the_rank(session, tmp_path):
    # A bad value fails on every rank before any collective (nobody is left waiting).
    session.push({"path": str(tmp_path / "bad")})
    with pytest.raises(RankError, match=r"ranks 0-1: CheckpointError: step=-1"):
        session.run("nbdist.checkpoint.save(path, step=-1)")
    assert not os.path.exists(tmp_path / "bad")
