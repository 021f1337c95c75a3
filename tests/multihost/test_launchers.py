"""%dist_start --launcher slurm|ssh|mpi: options checked in a real shell before anything starts."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from nbdist.engine.netif import local_interfaces


def _this_machines_address() -> str | None:
    """A non-loopback IPv4 address of this machine: what --ip must name for engines elsewhere."""
    for addresses in local_interfaces().values():
        for address in addresses:
            if "." in address and not address.startswith("127."):
                return address
    return None


ADDR = _this_machines_address()
needs_address = pytest.mark.skipif(ADDR is None, reason="this machine has no non-loopback IPv4")


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    return sh


@pytest.mark.parametrize(
    "line, message",
    [
        ("--launcher ssh --hosts node1:2", "pass --ip with this machine's address"),
        ("16 --launcher slurm --ip {ADDR} --time soon", "time 'soon' is not a Slurm time limit"),
        ("--launcher slurm --ip {ADDR}", "needs the number of ranks"),
        ("--launcher ssh --ip {ADDR}", "needs the hosts"),
        ("3 --launcher ssh --ip {ADDR} --hosts a:2,b:2", "3 ranks but the hosts list 4"),
        ("4 --partition gpu", "need a launcher"),
        ("4 --launcher slurm --ip {ADDR} --launch-opt gpus_per_node", "KEY=VALUE"),
        ("4 --launcher slurm --ip {ADDR} --launch-opt colour=red", "no option 'colour'"),
    ],
)
@needs_address
def test_bad_launcher_options_are_usage_errors_and_start_nothing(shell, line, message):
    magics = shell.magics_manager.registry["DistMagics"]
    before = magics.session  # the shell is shared: an earlier test may have left a stopped one
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("dist_start", line.format(ADDR=ADDR))
    assert magics.session is before
    assert before is None or not before.running


@needs_address
def test_session_keeps_the_launch_plan_and_a_provisional_layout():
    s = nbdist.DistSession(
        16,
        launcher="slurm",
        ip=ADDR,
        launch_options={"partition": "gpu", "time": "01:00:00", "gpus_per_node": "8"},
    )
    assert not s.running
    assert s.options.launch.engine_launcher == "slurm"
    template = s.options.launch.config["SlurmEngineSetLauncher"]["batch_template"]
    assert "#SBATCH --partition=gpu" in template and "#SBATCH --nodes=2" in template
    # The login node's GPUs say nothing about the compute nodes': decided when engines report.
    assert s.placement.world_size == 16 and not s.placement.uses_gpus
