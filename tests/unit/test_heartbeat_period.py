"""The controller's heartbeat: its period grows with the ranks, the silence it allows does not."""

from __future__ import annotations

import pytest

from nbdist.launch.heartbeat import misses, period_ms
from nbdist.launch.slurm_job import SlurmEngineJob


@pytest.mark.parametrize("n", [1, 2, 8, 9, 16, 64, 100, 256, 1024, 4096])
def test_the_silence_before_a_rank_is_dropped_stays_the_same_at_every_size(n):
    period = period_ms(n)
    # 30 s for ranks the zygote forked (their PIDs are watched), 10 s for a launcher's, less
    # at most one beat (whole beats).
    for launcher, silence_ms in ((None, 30_000), (SlurmEngineJob, 10_000)):
        allowed = misses(launcher, period) * period
        assert silence_ms - period < allowed <= silence_ms, (launcher, period, allowed)
    assert misses(SlurmEngineJob, period) >= 5


def test_up_to_8_ranks_the_start_keeps_its_fast_beat_and_beyond_the_controller_reads_as_much():
    assert [period_ms(n) for n in (1, 2, 4, 8)] == [50] * 4
    # Replies the controller reads per second: as for 8 ranks, until the 2 s ceiling.
    for n in (16, 64, 256):
        assert n * 1000 / period_ms(n) == pytest.approx(8 * 1000 / 50)
    assert period_ms(1024) == period_ms(4096) == 2000
