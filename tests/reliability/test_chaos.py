"""Chaos while training: a rank SIGKILLed at random steps, %dist_restart, resume from the last checkpoint.

A DDP loop (2 CPU ranks, gloo) saves with ``nbdist.checkpoint`` every K steps;
one rank kills itself with SIGKILL at steps drawn at random (seeded) three
times in a run; after each death the session restarts (fresh processes) and
the loop resumes with ``nbdist.checkpoint.resume``. The final weights must be
bitwise those of the same run without interruption, and the run's history
must show the restarts.
"""

from __future__ import annotations

import random

import pytest
import torch

import nbdist
from nbdist.errors import NbdistError
from nbdist.metrics.hub import RESTART_KEY

STEPS, EVERY = 40, 5

# Seeded model and per-step data: a step's result depends only on the weights and the
# optimizer state it starts from, which the checkpoint holds.
SETUP = f"""
import os, signal
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
net = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
opt = torch.optim.AdamW(net.parameters(), lr=0.05)

def train(start, stop, ckpt, kill_at=None):
    for step in range(start, stop):
        if step == kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        nbdist.log(step=step, loss=loss.item())
        if ckpt and (step + 1) % {EVERY} == 0:
            nbdist.checkpoint.save(f"{{ckpt}}/step_{{step + 1}}", model=net, optimizer=opt,
                                   step=step + 1)

def flat():
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])
"""


@pytest.fixture
def session(tmp_path):
    s = nbdist.DistSession(2, cpu=True, timeout=120, history=str(tmp_path / "history.sqlite"))
    s.start()
    try:
        yield s
    finally:
        s.stop()


def test_training_killed_at_random_steps_resumes_to_the_same_weights(session, tmp_path):
    session.run(SETUP)
    session.run(f"train(0, {STEPS}, None)")
    reference = session.pull("flat()", rank=0)

    ckpt = str(tmp_path / "ckpt")
    kills = sorted(random.Random(32).sample(range(1, STEPS - 1), 3))
    for kill_at in kills:
        session.restart()
        session.run(SETUP)
        session.run(f"start = nbdist.checkpoint.resume({ckpt!r}, model=net, optimizer=opt)")
        start = session.pull("start", rank=0)
        assert start % EVERY == 0 and start <= kill_at, (start, kill_at)
        with pytest.raises(NbdistError, match="died"):
            session.run(f"train(start, {STEPS}, {ckpt!r}, kill_at={kill_at})")
    session.restart()
    session.run(SETUP)
    session.run(f"start = nbdist.checkpoint.resume({ckpt!r}, model=net, optimizer=opt)")
    session.run(f"train(start, {STEPS}, {ckpt!r})")
    resumed = session.pull("flat()", rank=0)
    assert torch.equal(resumed, reference), (resumed - reference).abs().max()

    restarts = [
        p for p in session.metrics.rows() if p.get(RESTART_KEY) is not None and p["rank"] == 0
    ]
    assert [int(p[RESTART_KEY]) for p in restarts] == [1, 2, 3, 4], restarts
