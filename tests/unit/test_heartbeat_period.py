"""The controller's heartbeat: its period grows with the ranks, the silence it allows does not
(and never ends a rank of this machine, whose death its pidfd shows)."""

from __future__ import annotations

import pytest

from nbdist.launch.heartbeat import misses, period_ms, pidfds_work
from nbdist.launch.slurm_job import SlurmEngineJob


@pytest.mark.parametrize("n", [1, 2, 8, 9, 16, 64, 100, 256, 1024, 4096])
def test_the_silence_before_a_rank_is_dropped_stays_the_same_at_every_size(n):
    period = period_ms(n)
    # 10 s for a launcher's ranks (the heartbeat is all that tells their deaths), less at
    # most one beat (whole beats).
    allowed = misses(SlurmEngineJob, period) * period
    assert 10_000 - period < allowed <= 10_000, (period, allowed)
    assert misses(SlurmEngineJob, period) >= 5
    # Ranks the zygote forked, whose deaths their pidfds show at once, are never dropped for
    # silence (a debugger holding one stops its heart): more than a year of beats.
    assert pidfds_work()  # Linux >= 5.3, as on the machines nbdist is tested on
    assert misses(None, period) * period > 365 * 24 * 3600 * 1000


def test_up_to_8_ranks_the_start_keeps_its_fast_beat_and_beyond_the_controller_reads_as_much():
    assert [period_ms(n) for n in (1, 2, 4, 8)] == [50] * 4
    # Replies the controller reads per second: as for 8 ranks, until the 2 s ceiling.
    for n in (16, 64, 256):
        assert n * 1000 / period_ms(n) == pytest.approx(8 * 1000 / 50)
    assert period_ms(1024) == period_ms(4096) == 2000
