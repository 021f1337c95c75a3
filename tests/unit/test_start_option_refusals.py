"""Options that used to pass the check and fail after processes started, or be ignored.

Each is refused by ``check_start_options`` (before anything starts) with the value
and the fix, in the words a user sees.
"""

from __future__ import annotations

import pytest

from nbdist.errors import PlacementError
from nbdist.launch.options import StartOptions, check_start_options


def _refusal(**options) -> str:
    with pytest.raises(PlacementError) as info:
        check_start_options(StartOptions(**options))
    return str(info.value)


@pytest.mark.parametrize("ip", ["::1", "fe80::1", "::"])
def test_an_ipv6_controller_address_is_refused(ip):
    # '::1' passed the check, then the controller crashed in zmq ("No such device") and the
    # start reported a timeout.
    assert _refusal(n=2, cpu=True, ip=ip) == (
        f"--ip {ip!r} is an IPv6 address, and the controller listens on IPv4 only: give an "
        "IPv4 address, e.g. 127.0.0.1 (the default) or this host's IPv4 address on the network "
        "the ranks share (`hostname -I` lists them)"
    )


@pytest.mark.parametrize(
    "name, value, what",
    [
        ("NBDIST_OUTPUT_LINES", "abc", "lines of each rank a cell's folded output keeps"),
        ("NBDIST_OUTPUT_LINES", "-1", "lines of each rank a cell's folded output keeps"),
        ("NBDIST_OUTPUT_LIMIT", "-5", "characters of each rank's stdout (or stderr) a cell shows"),
        (
            "NBDIST_OUTPUT_LIMIT",
            "lots",
            "characters of each rank's stdout (or stderr) a cell shows",
        ),
    ],
)
def test_a_bad_output_setting_is_refused_before_the_ranks_start(monkeypatch, name, value, what):
    # NBDIST_OUTPUT_LINES=abc was found at the first cell, after every rank had started (a raw
    # ValueError); NBDIST_OUTPUT_LIMIT=-5 was taken as it was.
    monkeypatch.setenv(name, value)
    assert _refusal(n=2, cpu=True).startswith(
        f"{name}={value!r}: give the {what} as a whole number, 0 for all (e.g. {name}="
    )


def test_good_output_settings_pass(monkeypatch):
    monkeypatch.setenv("NBDIST_OUTPUT_LINES", "0")
    monkeypatch.setenv("NBDIST_OUTPUT_LIMIT", "4096")
    assert check_start_options(StartOptions(n=2, cpu=True)).n == 2


@pytest.mark.parametrize(
    "launcher, launch_options, fix",
    [
        ("slurm", {}, "--launch-opt gpus_per_node=K (one rank per GPU)"),
        ("ssh", {"hosts": "localhost:2"}, "hosts=node1:K (K ranks per host, one per GPU)"),
        ("local", {}, "an ipyparallel profile (--profile)"),
    ],
)
def test_gpus_with_a_launcher_are_refused_with_the_launchers_own_option(
    launcher, launch_options, fix
):
    # --gpus 0,1 with --launcher was silently ignored: the launcher placed the ranks.
    said = _refusal(n=2, gpus=(0, 1), launcher=launcher, launch_options=launch_options)
    assert said == (
        f"--gpus 0,1 picks GPUs for engines nbdist starts itself; with --launcher {launcher} "
        "each rank uses cuda:<its local rank> of the GPUs its host shows: leave --gpus out, "
        f"and set the GPUs per host with {fix}"
    )


@pytest.mark.parametrize("launcher", ["slurm", "mpi", "local"])
def test_spawn_with_a_launcher_is_refused(launcher):
    assert _refusal(n=2, cpu=True, start_method="spawn", launcher=launcher) == (
        f"--spawn picks how nbdist's own engines start; --launcher {launcher} starts each "
        "engine as a process of its own already: leave --spawn out"
    )


@pytest.mark.parametrize("name", ["os.path", "os.path.join", "nbdist.launch.options.StartOptions"])
def test_an_importable_name_that_is_no_launcher_is_refused(name):
    # --launcher os.path passed, then ipyparallel raised a 30-frame TraitError.
    assert _refusal(n=2, cpu=True, launcher=name).startswith(
        f"--launcher {name!r} is not an ipyparallel engine launcher: use one of "
    )
    options = check_start_options(
        StartOptions(n=2, cpu=True, launcher="ipyparallel.cluster.launcher.LocalEngineSetLauncher")
    )
    assert options.launcher.endswith("LocalEngineSetLauncher")


@pytest.mark.parametrize("seconds", [0.001, 1.5])
def test_a_group_timeout_too_short_to_form_the_group_is_refused(seconds):
    assert _refusal(n=2, cpu=True, group_timeout=seconds) == (
        f"group_timeout {seconds!r} is too short: it bounds the group's forming too (each "
        "rank connects to rank 0's store, then a first collective), which can take over a "
        "second on a busy machine; give at least 2 s (default 1800)"
    )
    assert check_start_options(StartOptions(n=2, cpu=True, group_timeout=2)).group_timeout == 2
