"""The step breakdown on a GPU rank: collectives on CUDA tensors timed by CUDA events, and
only as many events held as a bounded number, whatever the cell does. Skipped without CUDA.
"""

from __future__ import annotations

import math

import nbdist
from nbdist.driver.sinks import ListSink
from nbdist.metrics.steptime import MAX_EVENT_PAIRS


def test_cuda_collectives_hold_no_events_unlogged_and_a_bounded_number_between_points():
    with nbdist.DistSession(1, timeout=300) as s:
        s.run(
            "from nbdist.metrics import steptime\n"
            "t = torch.ones(256, device=device)\n"
            "for _ in range(2000):\n"
            "    dist.all_reduce(t)\n"
            "torch.cuda.synchronize()\n"
            "held_unlogged = len(steptime.timers.events)\n",
            sink=ListSink(),
        )
        # A cell logging rarely: many collectives between two points.
        s.run(
            "nbdist.log(step=0)\n"
            "for _ in range(3000):\n"
            "    dist.all_reduce(t)\n"
            "held_most = len(steptime.timers.events)\n"
            "nbdist.log(step=1)\n"
            "torch.cuda.synchronize()\n",
            sink=ListSink(),
        )
        assert s.pull("held_unlogged", rank=0) == 0  # one pair per call before: 2000
        assert 0 < s.pull("held_most", rank=0) <= MAX_EVENT_PAIRS  # 3000 before
        run = s.metrics_hub.run
        steps, comm = run.series("comm_s", 0)
        _, step_time = run.series("step_time", 0)
        assert list(steps) == [1]  # the cell's first point has no breakdown
        # 3000 all_reduces on the GPU took device time, never more than the step's wall time.
        assert not math.isnan(comm[0]) and 0 < comm[0] <= step_time[0]
