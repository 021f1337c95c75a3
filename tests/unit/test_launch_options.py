"""Unit tests for nbdist.launch.options: launcher options -> ipyparallel launcher configuration.

No Slurm or remote hosts here: the configuration is handed to ipyparallel's
real launcher classes, and the batch script / command line they build is checked.
"""

from __future__ import annotations

import pytest
from ipyparallel.cluster.launcher import (
    MPIEngineSetLauncher,
    SlurmEngineSetLauncher,
    SSHEngineSetLauncher,
)
from traitlets.config import Config

from nbdist.errors import PlacementError
from nbdist.launch.launcher_options import parse_hosts, plan_launch
from nbdist.launch.options import parse_launch_options

IP = "10.1.0.5"


def _sbatch(plan, tmp_path) -> str:
    launcher = SlurmEngineSetLauncher(
        work_dir=str(tmp_path),
        config=Config(plan.config),
        profile_dir=str(tmp_path),
        cluster_id="c1",
    )
    launcher.write_batch_script(plan.n)
    return (tmp_path / launcher.batch_file_name).read_text()


def test_slurm_batch_script_carries_every_option(tmp_path):
    plan = plan_launch(
        "slurm",
        16,
        ip=IP,
        partition="gpu",
        time="02:30:00",
        account="proj-7",
        qos="high",
        gpus_per_node=8,
        cpus_per_task=12,
        sbatch="--mem=200G --exclusive",
    )
    assert plan.engine_launcher == "slurm"
    script = _sbatch(plan, tmp_path)
    lines = script.splitlines()
    assert lines[0] == "#!/bin/sh"
    for line in [
        "#SBATCH --ntasks=16",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=02:30:00",
        "#SBATCH --account=proj-7",
        "#SBATCH --qos=high",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=12",
        "#SBATCH --mem=200G",
        "#SBATCH --exclusive",
        "#SBATCH --job-name=ipengine-c1",
        "#SBATCH --export=ALL",
    ]:
        assert line in lines
    # Each option once (ipyparallel does not add its own copies), and srun starts the engines.
    assert script.count("--partition") == 1 and script.count("--time") == 1
    assert lines[-1].startswith("srun ") and "ipyparallel.engine" in lines[-1]


def test_slurm_minimal_script(tmp_path):
    script = _sbatch(plan_launch("slurm", 4, ip=IP), tmp_path)
    sbatch = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-c1",
        "#SBATCH --ntasks=4",
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        ({"time": "1 hour"}, "time '1 hour' is not a Slurm time limit"),
        ({"gpus_per_node": 3}, "10 ranks do not fill nodes of 3 GPUs"),
        ({"nodes": 11}, "nodes=11 is more than the 10 ranks"),
        ({"nodes": "two"}, "nodes 'two'"),
        ({"partition": "gpu\n#SBATCH --x"}, "characters a batch script would misread"),
        ({"partition": "{evil}"}, "characters a batch script would misread"),
        ({"sbatch": "-x node1"}, "give long options"),
        ({"hosts": "a:2"}, "has no option 'hosts'"),
    ],
)
def test_bad_slurm_options_name_the_value_and_the_fix(options, message):
    with pytest.raises(PlacementError, match=message.replace("(", r"\(")):
        plan_launch("slurm", 10, ip=IP, **options)


def test_slurm_needs_a_rank_count():
    with pytest.raises(PlacementError, match="needs the number of ranks"):
        plan_launch("slurm", None, ip=IP)


# Hosts elsewhere (a Slurm whose nodes are this machine may stay on loopback: tests/cluster).
@pytest.mark.parametrize(
    "launcher, options", [("ssh", {"hosts": "a:2"}), ("mpi", {"hosts": "a:2"})]
)
def test_engines_elsewhere_need_an_address_beyond_loopback(launcher, options):
    with pytest.raises(PlacementError, match="pass --ip with this machine's address"):
        plan_launch(launcher, 2, ip="127.0.0.1", **options)
    with pytest.raises(PlacementError, match="not an IP address"):
        plan_launch(launcher, 2, ip="no-such-host.invalid", **options)


def test_ssh_engines_per_host_reach_the_launcher():
    plan = plan_launch(
        "ssh", None, ip=IP, hosts="node1:4, alice@node2:2", python="/opt/py/bin/python"
    )
    assert plan.n == 6
    launcher = SSHEngineSetLauncher(config=Config(plan.config), profile_dir="/tmp", cluster_id="c")
    assert launcher.engines == {"node1": 4, "alice@node2": 2}
    assert launcher.remote_python == "/opt/py/bin/python"


def test_ssh_count_must_match_the_hosts():
    with pytest.raises(PlacementError, match="8 ranks but the hosts list 6"):
        plan_launch("ssh", 8, ip=IP, hosts="node1:4,node2:2")
    with pytest.raises(PlacementError, match="needs the hosts"):
        plan_launch("ssh", 4, ip=IP)


def test_mpi_hosts_become_mpiexec_arguments():
    plan = plan_launch("mpi", None, ip=IP, hosts="a:2,b:2", mpi_args="--bind-to none")
    launcher = MPIEngineSetLauncher(config=Config(plan.config), profile_dir="/tmp", cluster_id="c")
    launcher.n = plan.n
    args = launcher.find_args()
    assert args[:3] == ["mpiexec", "-n", "4"]
    assert args[3:7] == ["--host", "a:2,b:2", "--bind-to", "none"]


def test_mpi_on_this_machine_may_stay_on_loopback():
    plan = plan_launch("mpi", 2, ip="127.0.0.1")
    assert (plan.n, plan.config) == (2, {"MPIEngineSetLauncher": {}})


def test_other_launchers_pass_through_without_options():
    assert plan_launch("pbs", 4, ip="127.0.0.1").engine_launcher == "pbs"
    with pytest.raises(PlacementError, match="takes no nbdist options"):
        plan_launch("pbs", 4, ip=IP, partition="x")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("a:2,b:3", {"a": 2, "b": 3}),
        ("a", {"a": 1}),
        ("10.0.0.7:2", {"10.0.0.7": 2}),
        ({"x": 4}, {"x": 4}),
    ],
)
def test_parse_hosts(text, expected):
    assert parse_hosts(text) == expected


@pytest.mark.parametrize("text", ["a:x", ":3", "a:0", ""])
def test_parse_hosts_refuses_bad_entries(text):
    with pytest.raises(PlacementError, match="node1:4"):
        parse_hosts(text)


@pytest.mark.parametrize(
    "text, said",
    [
        # An IPv6 address's colons were read as host:ranks: 'fe80::1' became {'fe80:': 1}.
        ("fe80::1", "hosts: 'fe80::1' is an IPv6 address, which nbdist's launchers do not take"),
        ("::1", "hosts: '::1' is an IPv6 address"),
        ("[::1]:2", "hosts: '[::1]:2' is an IPv6 address"),
        ("a:2:3", "hosts 'a:2:3': 'a:2:3' has more than one ':': write each host as host:ranks"),
        (
            "a:2,a:2",
            "hosts 'a:2,a:2' names 'a' twice: give each host once, with all its ranks, e.g. a:4",
        ),
        ("a:99999999999999", "hosts: 'a' with 999999999999... ranks is beyond what any machine's"),
    ],
)
def test_hosts_that_would_be_misread_are_refused_with_the_fix(text, said):
    with pytest.raises(PlacementError) as info:
        parse_hosts(text)
    assert str(info.value).startswith(said)


def test_more_ranks_over_the_hosts_than_the_limits_hold_are_refused(monkeypatch):
    from nbdist.launch import capacity

    limits = capacity.current_limits()
    monkeypatch.setattr(
        capacity,
        "current_limits",
        lambda: capacity.Limits(**{**limits.__dict__, "open_files_hard": 4096}),
    )
    assert parse_hosts("a:100,b:100") == {"a": 100, "b": 100}
    with pytest.raises(PlacementError) as info:
        parse_hosts("a:4000,b:4000")
    assert str(info.value).startswith(
        "hosts: 8000 ranks in all are too many here: 8000 ranks need about"
    )
    assert "the limit is 4096 (hard limit, `ulimit -Hn`)" in str(info.value)


@pytest.mark.parametrize("args", ["-np 4", "-n 4", "--np=4", "--n 4", "-c 4"])
def test_mpi_args_that_set_the_process_count_are_refused(args):
    # mpi_args=-np 4 started 4 engines for 2 ranks.
    with pytest.raises(PlacementError) as info:
        plan_launch("mpi", 2, ip="127.0.0.1", mpi_args=args)
    flag = args.split()[0]
    assert str(info.value) == (
        f"mpi_args {flag!r} sets the number of processes, which nbdist gives mpiexec from the "
        "number of ranks: leave it out, and give the count as N (%dist_start N --launcher mpi)"
    )


@pytest.mark.parametrize(
    "extra, fix",
    [
        ("--ntasks=1", "give the number of ranks as N (%dist_start N)"),
        ("-n 3", "give the number of ranks as N (%dist_start N)"),
        ("--ntasks-per-node=2", "use gpus_per_node=K"),
        ("--export=NONE", "leave it out: nbdist exports the notebook's environment"),
        ("--job-name=mine", "leave it out: nbdist names the job"),
        ("-J mine", "leave it out: nbdist names the job"),
        ("--output=/tmp/x", "leave it out: nbdist places the job's output"),
        ("-o /tmp/x", "leave it out: nbdist places the job's output"),
        ("--error=/tmp/e", "leave it out: nbdist places the job's output and errors"),
        ("-e /tmp/e", "leave it out: nbdist places the job's output and errors"),
    ],
)
def test_sbatch_options_that_override_nbdists_job_are_refused(extra, fix):
    # sbatch=--ntasks=1 was accepted: the job then ran 1 engine, and the start waited out its
    # whole timeout for the second.
    with pytest.raises(PlacementError) as info:
        plan_launch("slurm", 2, ip=IP, sbatch=extra)
    flag = extra.split()[0]
    assert str(info.value).startswith(f"sbatch option {flag!r} sets what nbdist's job sets: {fix}")


def test_parse_launch_options():
    assert parse_launch_options(["partition=gpu", "gpus-per-node=8"]) == {
        "partition": "gpu",
        "gpus_per_node": "8",
    }
    with pytest.raises(PlacementError, match="KEY=VALUE"):
        parse_launch_options(["partition"])


def test_a_launch_option_with_spaces_is_quoted_whole_in_the_magic_line():
    from IPython.utils.process import arg_split

    # Items that still hold their quotes (IPython's own split keeps them; the magics take
    # off those around a whole word) lose them here.
    items = arg_split('"mpi_args=--bind-to none --oversubscribe" partition=gpu', posix=False)
    assert parse_launch_options(items) == {
        "mpi_args": "--bind-to none --oversubscribe",
        "partition": "gpu",
    }
    assert parse_launch_options(["ssh_args='-p 2222'"]) == {"ssh_args": "-p 2222"}


def test_a_host_name_resolving_to_loopback_is_refused_too():
    with pytest.raises(PlacementError, match="cannot reach a controller on localhost"):
        plan_launch("ssh", 2, ip="localhost", hosts="a:2")
