"""Where engines run decides whether the controller may stay on loopback (real sinfo, ssh -G)."""

from __future__ import annotations

import shutil

import pytest

from nbdist.errors import PlacementError
from nbdist.launch.launcher_options import plan_launch

needs_ssh = pytest.mark.skipif(shutil.which("ssh") is None, reason="no ssh client")


@needs_ssh
def test_ssh_hosts_that_are_this_machine_keep_loopback(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host here-alias\n  HostName 127.0.0.1\n")
    plan = plan_launch("ssh", None, ip="127.0.0.1", hosts="here-alias:2", ssh_args=f"-F {config}")
    assert plan.n == 2
    with pytest.raises(PlacementError, match="pass --ip with this machine's address"):
        plan_launch("ssh", None, ip="127.0.0.1", hosts="node-elsewhere.invalid:2")


def test_mpi_hosts_in_mpi_args_need_an_address_beyond_loopback():
    assert plan_launch("mpi", 2, ip="127.0.0.1", mpi_args="--bind-to none").n == 2
    with pytest.raises(PlacementError, match="pass --ip with this machine's address"):
        plan_launch("mpi", 2, ip="127.0.0.1", mpi_args="--hostfile nodes.txt")


def test_a_one_node_slurm_keeps_loopback_and_writes_the_log_privately(slurm):
    plan = plan_launch("slurm", 2, ip="127.0.0.1", time="10")
    template = plan.config["SlurmEngineSetLauncher"]["batch_template"]
    assert "#SBATCH --output={output_file}" in template  # the profile's own log directory
