"""Point-to-point calls replaced by nbdist's host-memory staging still serve their users.

On a GPU shared over gloo nbdist replaces ``send``/``recv``/``isend``/``irecv``/
``batch_isend_irecv`` (:mod:`nbdist.engine.p2p_staging`; the CUDA copies are
checked in ``tests/gpu/test_placement_gpu.py``). The replacements must keep every
caller working: ``P2POp``'s identity check, torch's pipelining (which posts
homogeneous batches through ``p2p.op`` itself), nbdist's send/recv ring, and
``%dist_where``'s record of the last collective. Here they are installed on CPU
ranks, where the same code runs with CPU tensors, and each caller's numbers are
compared with a reference: exact integers in float32 (tolerance zero), and a
pipeline's loss against the same model trained in one process.
"""

from __future__ import annotations

import pytest
import torch

from nbdist.driver.sinks import ListSink
from tests.dist.ranks_with import ranks_with

STAGED = """
from nbdist.engine import p2p_staging, collectives
p2p_staging.install()
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
from nbdist.strategies import scratch

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
scratch.ring_all_reduce(ring)
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
    """torch's pipelining (1F1B) over 2 stages: the loss equals one process's on the same model.

    Reference: float32 forward and backward of the same 2-layer model in one process;
    the pipeline sums 4 micro-batch losses in another order, so a relative tolerance
    of a few float32 units (1e-5) bounds the difference.
    """
    session.run(
        """
import torch.nn.functional as F
from torch import nn
from nbdist.strategies.pipeline import pipeline_schedule

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
stage, schedule = pipeline_schedule(model, n_microbatches=4, loss_fn=F.mse_loss)
losses = []
if stage.is_first:
    schedule.step(x)
else:
    schedule.step(target=y, losses=losses)
pipe_loss = sum(float(l) for l in losses) / 4 if losses else None
""",
        sink=ListSink(),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    want = sum(
        torch.nn.functional.mse_loss(model(xs), ys).item()
        for xs, ys in zip(x.chunk(4), y.chunk(4))
    ) / 4
    first, last = session.pull("pipe_loss")
    assert first is None
    assert last == pytest.approx(want, rel=1e-5)
