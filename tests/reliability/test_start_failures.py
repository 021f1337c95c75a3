"""A start that fails or is interrupted after its processes exist (2 real CPU ranks, in this process).

The steps after the engines registered (noting their PIDs, making the connection
files private, recording the processes for a later clean-up) ran outside the
clean-up of a failed start: a Ctrl-C there left the whole cluster running while
``%dist_start`` said that what it had started was stopped. A controller that
exited was reported as a timeout, below ipyparallel's own 40-line warning.
"""

from __future__ import annotations

import logging

import psutil
import pytest

from nbdist.errors import NbdistError
from nbdist.launch import cluster, private_profiles
from nbdist.launch.options import StartOptions, check_start_options
from nbdist.launch.placement import plan_start
from tests.conftest import wait_gone


def _interrupt_once(monkeypatch, module, name: str) -> None:
    original = getattr(module, name)

    def interrupted(*args, **kwargs):
        monkeypatch.setattr(module, name, original)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, name, interrupted)


@pytest.mark.parametrize(
    "module, step",
    [(cluster, "_secure_connection_files"), (private_profiles, "record_processes")],
)
def test_an_interrupt_after_the_engines_registered_stops_every_process(monkeypatch, module, step):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    options = check_start_options(StartOptions(n=2, cpu=True, timeout=120))
    _interrupt_once(monkeypatch, module, step)
    with pytest.raises(KeyboardInterrupt):
        cluster.start_processes(options, plan_start(options))
    started = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    left = wait_gone(started, timeout=15)
    names = []
    for pid in left:  # named, then ended: a failure here must not leave them to other tests
        try:
            proc = psutil.Process(pid)
            names.append(f"{pid}: {' '.join(proc.cmdline())[:100]}")
            proc.kill()
        except psutil.Error:
            pass
    assert names == [], "left running after an interrupted start:\n" + "\n".join(names)


def test_an_interrupt_is_not_taken_for_a_port_clash_to_start_again(monkeypatch):
    """A controller that met a taken port (two notebooks starting at once) makes the start try
    once more with fresh ports; a Ctrl-C in that start ended up starting a second cluster (a
    Slurm job submitted again), as if the clash had failed it. A Ctrl-C ends the start."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    options = check_start_options(StartOptions(n=2, cpu=True, timeout=120))
    monkeypatch.setattr(cluster, "port_clash", lambda *a, **k: "bind: Address already in use")
    _interrupt_once(monkeypatch, cluster, "_secure_connection_files")
    attempts = []
    real_attempt = cluster._start_attempt  # noqa: SLF001

    def counted(*args, **kwargs):
        attempts.append(1)
        return real_attempt(*args, **kwargs)

    monkeypatch.setattr(cluster, "_start_attempt", counted)
    with pytest.raises(KeyboardInterrupt):
        cluster.start_processes(options, plan_start(options))
    assert len(attempts) == 1
    started = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert wait_gone(started, timeout=15) == []


def test_a_controller_that_exits_is_named_with_its_output_once(caplog):
    # The options check refuses an IPv6 --ip now; past it, the controller still exits at once.
    options = check_start_options(StartOptions(n=2, cpu=True))
    envs = cluster.slot_environments(plan_start(options))
    caplog.set_level(logging.DEBUG, logger="nbdist.launch.cluster")
    with pytest.raises(NbdistError) as info:
        cluster.start_local(n=2, slot_environments=envs, threads=1, timeout=60, ip="::1")
    said = str(info.value)
    assert said.startswith(
        "the controller exited (exit code 1) before the 2 ranks started; its last words:\n"
        "--- controller output ---\n"
    ), said
    assert "ZMQError" in said and "did not all start within" not in said
    # ipyparallel's own warning with the same output stayed out of the cell.
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in shown if "Output for" in m or "Controller stopped" in m], shown


def test_a_launchers_output_is_shown_once_in_nbdists_error(caplog):
    # ipyparallel warned "Output for ipengine-...:" with the output, then nbdist's error
    # repeated it under "--- launcher output ---". A launcher that prints and exits stands
    # for mpiexec here (its arguments follow the "--").
    options = check_start_options(
        StartOptions(
            n=2,
            cpu=True,
            timeout=60,
            launcher="mpi",
            launch_options={"mpi_cmd": "sh -c 'echo boom from the launcher; exit 3' --"},
        )
    )
    caplog.set_level(logging.WARNING, logger="nbdist.launch.cluster")
    with pytest.raises(NbdistError) as info:
        cluster.start_processes(options, plan_start(options))
    said = str(info.value)
    assert said.startswith("sh exited"), said
    assert said.endswith(
        "before its 2 ranks started (0 had registered)\n"
        "--- launcher output ---\nboom from the launcher"
    ), said
    shown = [r.getMessage() for r in caplog.records]
    assert not [m for m in shown if "boom" in m or "stopped" in m], shown
