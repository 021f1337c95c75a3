"""Point-to-point calls replaced by nbdist's host-memory staging still serve their users.

On a GPU shared over gloo nbdist replaces ``send``/``recv``/``isend``/``irecv``/
``batch_isend_irecv`` (:mod:`nbdist.engine.p2p_staging`; the CUDA copies are
checked in ``tests/gpu/test_placement_gpu.py``). The replacements must keep every
caller working: ``P2POp``'s identity check, torch's pipelining (which posts
homogeneous batches through ``p2p.op`` itself), nbdist's send/recv ring, and
``%dist_where``'s record of the last collective. Here they are installed on CPU
ranks, where the same code runs with CPU tensors, and each caller's numbers are
compared with a reference: exact integers in float32 (tolerance zero), and a
pipeline's loss and gradients against the same model trained in one process.
They are installed with ``stage_cpu_tensors=True``: CPU tensors then take the
path CUDA tensors take (copy out, receive into a buffer, copy back), which is
what broke torch's pipelining on an H200 (the copy into a received leaf that
requires grad ran under autograd).
"""

from __future__ import annotations

import pytest
import torch

from nbdist.driver.sinks import ListSink
from tests.dist.ranks_with import ranks_with

STAGED = """
from nbdist.engine import p2p_staging, collectives
p2p_staging.install(stage_cpu_tensors=True)  # every send/recv through host copies, as on a GPU
p2p_staging.install()  # idempotent
collectives.install()  # the order a group on a shared GPU forms in: staged, then tracked
"""


@pytest.fixture(scope="module")
def session():
    yield from ranks_with(2, STAGED)


def test_send_recv_and_batched_p2p_keep_working_once_staged(session):
    session.run(
        """
import torch.distributed.distributed_c10d as c10d
from nbdist.strategies.teaching import data_parallel_by_hand as by_hand

replaced = [hasattr(dist.send, "nbdist_original"), dist.isend is c10d.isend,
            hasattr(dist.isend, "nbdist_plain"), p2p_staging.installed()]
mine = torch.full((5,), float(rank + 1))
other = torch.empty(5)
if rank == 0:
    dist.send(mine, dst=1)
    dist.recv(other, src=1)
else:
    dist.recv(other, src=0)
    dist.send(mine, dst=0)
last_op = collectives.last()["op"]
posted = torch.empty(5)
works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, posted, 1 - rank)])
for w in works:
    w.wait()
ring = torch.arange(1001, dtype=torch.float32) * (rank + 1)
by_hand.ring_all_reduce(ring)
""",
        sink=ListSink(),
    )
    # dist.send is nbdist's tracked wrapper around the staged send; isend is the staged
    # one in both namespaces, so P2POp accepts it.
    assert session.pull("replaced") == [[True, True, True, True]] * 2
    assert session.pull("last_op") == ["recv", "send"]  # still counted: rank 0 received last
    for rank, (other, posted, ring) in enumerate(
        zip(session.pull("other"), session.pull("posted"), session.pull("ring"))
    ):
        assert torch.equal(other, torch.full((5,), float(2 - rank)))
        assert torch.equal(posted, torch.full((5,), float(2 - rank)))
        assert torch.equal(ring, torch.arange(1001, dtype=torch.float32) * 3)


def test_a_pipeline_trains_through_the_staged_calls(session):
    """torch's pipelining (GPipe and 1F1B) over 2 stages, 3 steps of SGD each: every
    step's loss and the final weights equal one process training the same model.

    Several steps matter: from the second step on, the receiving stage receives
    into buffers that already require grad (the first step set it), which is where
    a receive's copy under autograd raised on a GPU. Reference: float32 forward and
    backward of the same 2-layer model in one process on the mean of 4 micro-batch
    losses; the pipeline sums the same products in another order, so a relative
    tolerance of a few float32 units (1e-5; atol 1e-6 for weights near zero) bounds
    the difference.
    """
    session.run(
        """
import torch.nn.functional as F
from torch import nn
from nbdist.strategies.parallel.pipeline import pipeline_schedule

x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
pipe_losses, pipe_weights = {}, {}
for kind in ("gpipe", "1f1b"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    stage, schedule = pipeline_schedule(model, n_microbatches=4, loss_fn=F.mse_loss, schedule=kind)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    pipe_losses[kind] = []
    for step in range(3):
        opt.zero_grad()
        losses = []
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
            pipe_losses[kind].append(sum(float(l) for l in losses) / 4)
        opt.step()
    pipe_weights[kind] = [p.detach().clone() for p in stage.submod.parameters()]
""",
        sink=ListSink(),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want_losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)  # = mean of the 4 micro-batch losses
        loss.backward()
        opt.step()
        want_losses.append(loss.item())
    want_weights = [p.detach() for p in model.parameters()]
    first, last = session.pull("pipe_losses")
    weights = session.pull("pipe_weights")
    for kind in ("gpipe", "1f1b"):
        assert first[kind] == []
        assert last[kind] == pytest.approx(want_losses, rel=1e-5), kind
        got = weights[0][kind] + weights[1][kind]  # stage 0 holds layer 0, stage 1 layer 1
        for g, w in zip(got, want_weights):
            torch.testing.assert_close(
                g, w, rtol=1e-5, atol=1e-6, msg=lambda m, kind=kind: f"{kind}: {m}"
            )
