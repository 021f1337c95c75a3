"""The limits checked before a start of many ranks: arithmetic, error text, the raised soft limit."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from nbdist.errors import NbdistError
from nbdist.launch.capacity import (
    GIB,
    MIB,
    Limits,
    check_limits,
    current_limits,
    needs_for,
    problems,
)

ROOMY = Limits(
    open_files_soft=1024,
    open_files_hard=1 << 20,
    user_processes=None,
    user_threads_now=100,
    tasks_max=32768,
    tasks_now=500,
    memory_available=20 * GIB,
)


def _with(**changes) -> Limits:
    return Limits(**(ROOMY.__dict__ | changes))


def test_open_files_grow_about_two_per_rank_from_what_the_kernel_holds():
    small = needs_for(2, local=2, rank0_local=True, fds_open=60)
    large = needs_for(256, local=256, rank0_local=True, fds_open=60)
    # The kernel (2 per rank) and rank 0 (its peers and the rendezvous store) bind alike.
    assert large.open_files - small.open_files == 2 * (256 - 2)
    assert (
        needs_for(256, local=256, rank0_local=True, fds_open=600).open_files == 600 + 2 * 256 + 64
    )
    # Ranks elsewhere: only the kernel's share is this machine's.
    remote = needs_for(256, local=0, rank0_local=False, fds_open=60)
    assert remote.open_files == 60 + 2 * 256 + 64
    assert remote.threads == 0 and remote.memory == 0


def test_memory_is_the_base_plus_each_rank_forked_or_spawned():
    forked = needs_for(256, local=256, rank0_local=True, fds_open=0)
    spawned = needs_for(256, local=256, rank0_local=True, fds_open=0, spawn=True)
    assert forked.memory == 512 * MIB + 256 * 30 * MIB  # 8 GiB: 7.4 GiB measured at 256
    assert spawned.memory == 512 * MIB + 256 * 350 * MIB
    assert needs_for(8, local=8, rank0_local=True, fds_open=0, threads=2).threads == 8 * 18


def test_nothing_is_wrong_on_a_roomy_machine_at_256():
    assert problems(needs_for(256, local=256, rank0_local=True, fds_open=60), ROOMY) == []


def test_a_soft_open_files_limit_below_the_need_is_no_problem_while_the_hard_one_allows():
    needs = needs_for(1024, local=0, rank0_local=False, fds_open=60)
    assert needs.open_files > ROOMY.open_files_soft
    assert problems(needs, ROOMY) == []


def test_a_hard_open_files_limit_below_the_need_names_value_limit_and_fix():
    needs = needs_for(256, local=256, rank0_local=True, fds_open=60)
    [text] = problems(needs, _with(open_files_soft=256, open_files_hard=256))
    assert text.startswith("256 ranks need about 636 open files per process")
    assert "the limit is 256 (hard limit, `ulimit -Hn`)" in text
    assert "`ulimit -n 1024`" in text and "restart the kernel" in text


def test_threads_against_the_users_process_limit():
    needs = needs_for(256, local=256, rank0_local=True, fds_open=60)
    [text] = problems(needs, _with(user_processes=4096, user_threads_now=300))
    assert text.startswith("256 ranks start about 4352 threads (17 per rank)")
    assert "your user already runs 300; the limit is 4096" in text
    assert "`ulimit -u 5120`" in text


def test_threads_against_the_systems_task_limit():
    needs = needs_for(256, local=256, rank0_local=True, fds_open=60)
    [text] = problems(needs, _with(tasks_max=4096, tasks_now=1000))
    assert "the machine runs 1000; the system allows 4096" in text
    assert "kernel.pid_max=6144" in text


def test_memory_against_what_is_available():
    needs = needs_for(256, local=256, rank0_local=True, fds_open=60, spawn=True)
    [text] = problems(needs, _with(memory_available=24 * GIB))
    assert text.startswith("256 ranks need about 88.0 GiB of memory to start (~350 MiB per rank")
    assert "24.0 GiB is available" in text
    assert text.endswith("or start them by fork (the default start method), sharing torch's memory")
    # Forked ranks share torch: the same machine fits them.
    assert problems(needs_for(256, local=256, rank0_local=True, fds_open=60), ROOMY) == []


def test_several_problems_are_all_named_and_the_error_says_nothing_started():
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))\n"
        "from nbdist.launch.capacity import check_limits\n"
        "try:\n"
        "    check_limits(4096, local=4096, spawn=True)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__); print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "NbdistError"
    assert lines[1].startswith("4096 ranks need about ")
    assert "the limit is 200 (hard limit" in lines[1]
    assert any(line.startswith("4096 ranks need about ") and "of memory" in line for line in lines)
    assert lines[-1] == "Nothing was started."


def test_the_soft_open_files_limit_is_raised_to_what_the_start_needs():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        note = check_limits(256, local=0)
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert note == f"open-files limit raised from 256 to {raised} for 256 ranks"
        assert raised >= 2 * 256
        # Enough already: nothing changes.
        assert check_limits(2, local=0) == ""
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_current_limits_reads_this_machine():
    limits = current_limits()
    assert limits.open_files_soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert limits.tasks_now >= limits.user_threads_now >= 1
    assert limits.memory_available is None or limits.memory_available > 0


def test_an_impossible_start_raises_nbdist_error():
    with pytest.raises(NbdistError, match="Nothing was started"):
        check_limits(100_000, local=100_000)


def test_a_start_far_beyond_the_machine_is_refused_before_any_work_per_rank(monkeypatch):
    # %dist_start 100000 --cpu hung: each rank's environment was worked out before the limits
    # were checked, by a pass over every slot per rank (10^10 steps). The limits come first now.
    from nbdist.launch import cluster
    from nbdist.launch.options import StartOptions, check_start_options
    from nbdist.launch.placement import Placement, plan_start

    options = check_start_options(StartOptions(n=100_000, cpu=True))
    placement = plan_start(options)

    def no_work_per_rank(self, host):
        raise AssertionError("a rank's environment was worked out before the limits refused")

    monkeypatch.setattr(Placement, "visible_mask", no_work_per_rank)
    with pytest.raises(NbdistError, match="Nothing was started"):
        cluster.start_processes(options, placement)


def test_each_ranks_environment_takes_one_pass_per_host():
    from nbdist.launch.cluster import slot_environments
    from nbdist.launch.placement import Placement, RankSlot

    hosts = ("a", "b")
    slots = tuple(
        RankSlot(rank=r, local_rank=r // 2, host=hosts[r % 2], gpu=r // 2, local_world_size=3)
        for r in range(6)
    )
    placement = Placement(slots=slots, backend="nccl", threads={"a": 1, "b": 1})
    calls = []
    original = Placement.visible_mask

    class Counted(Placement):
        def visible_mask(self, host):
            calls.append(host)
            return original(self, host)

    envs = slot_environments(Counted(slots=slots, backend="nccl", threads={"a": 1, "b": 1}))
    assert sorted(calls) == ["a", "b"]
    assert envs == slot_environments(placement)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1", "1", "2", "2"]
    assert {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,2"}


@pytest.mark.parametrize(
    "launcher, launch_options",
    [("local", None), ("mpi", None), ("ssh", {"hosts": "localhost:8"})],
)
def test_a_launcher_that_starts_every_rank_here_is_held_to_this_machines_limits(
    monkeypatch, launcher, launch_options
):
    # --launcher local, mpiexec without hosts, SSH to this machine: the limits were skipped
    # (as for ranks on other hosts), and 1000 ranks over ssh localhost started.
    import dataclasses

    from nbdist.launch import capacity, cluster, hosts
    from nbdist.launch.options import StartOptions, check_start_options
    from nbdist.launch.placement import plan_start

    monkeypatch.setattr(hosts, "ssh_hostname", lambda host, args: "127.0.0.1")
    options = check_start_options(
        StartOptions(n=8, cpu=True, launcher=launcher, launch_options=launch_options)
    )
    limits = dataclasses.replace(capacity.current_limits(), memory_available=1 << 30)
    monkeypatch.setattr(capacity, "current_limits", lambda: limits)

    def started(**kwargs):
        raise AssertionError("processes were started past the limits")

    monkeypatch.setattr(cluster, "start_local", started)
    with pytest.raises(NbdistError) as info:
        cluster.start_processes(options, plan_start(options))
    assert str(info.value).startswith(
        "8 ranks need about 3.2 GiB of memory to start (~350 MiB per rank, before any cell "
        "allocates) and 1.0 GiB is available"
    )
    assert str(info.value).endswith("Nothing was started.")


def test_ranks_on_other_hosts_are_not_held_to_this_machines_memory():
    from nbdist.launch.launcher_options import plan_launch

    assert plan_launch("mpi", 2, ip="127.0.0.1").here
    assert not plan_launch("mpi", 2, ip="10.1.0.5", hosts="node-elsewhere.invalid:2").here
