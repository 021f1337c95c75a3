"""Kernel side, before anything starts: every option of ``%dist_start`` / ``DistSession`` checked here.

One place refuses what could only fail after processes started, with the
value it saw and the fix: the rank count, threads, timeouts, start method,
``--ip``, ``--launcher``, ``--profile``, ``--connect``, ``--gpus``, and the
options of the Slurm, SSH and MPI launchers (partition, time, hosts, ...).
:func:`check_start_options` returns a :class:`StartOptions` that the session,
the placement planner (:mod:`nbdist.launch.placement`) and the launcher
configuration take as it is. Single values are checked by
:mod:`nbdist.launch.values`, the Slurm, SSH and MPI options by
:mod:`nbdist.launch.launcher_options`; this module is where a whole start is checked.

Example::

    >>> opts = check_start_options(StartOptions(4, cpu=True))
    >>> opts.n, opts.timeout, opts.launch is None
    (4, 120.0, True)
    >>> check_start_options(StartOptions(0))
    Traceback (most recent call last):
    ...
    nbdist.errors.PlacementError: number of ranks must be a whole number >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import socket
from collections.abc import Mapping

from nbdist.engine.controller_watch import DEFAULT_GONE_S
from nbdist.errors import PlacementError
from nbdist.launch.launcher_options import LAUNCHERS, LaunchPlan, plan_launch
from nbdist.launch.values import check_count, check_seconds, check_threads, is_digits, is_whole

__all__ = [
    "StartOptions",
    "check_start_options",
    "check_output_settings",
    "controller_gone_seconds",
    "parse_gpu_list",
    "parse_launch_options",
]

START_METHODS = ("fork", "spawn")
# The least --group-timeout. It bounds every wait of the group, the first ones too: each
# rank's connection to rank 0's TCP store and the first collective, a fraction of a second
# for a few idle ranks but several times that on a loaded machine, or for many ranks. Below
# 2 s the group failed to form with torch's own words ("--group-timeout 0.001").
MIN_GROUP_TIMEOUT_S = 2.0
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?")


@dataclasses.dataclass(frozen=True)
class StartOptions:
    """The options of one start (``DistSession``'s keywords); checked by :func:`check_start_options`.

    ``launch_options``: the Slurm/SSH/MPI launcher's options, as given;
    ``launch``: their checked plan (None for engines on this machine, or an
    cluster the session connects to), set by the check. ``controller_gone_s``: how
    long ranks that a launcher started wait for a vanished controller before they
    end themselves (``NBDIST_CONTROLLER_GONE_S``; None for the zygote's ranks, which
    end with the kernel, and for a cluster the session connects to), set by the check.
    """

    n: int | None = None
    backend: str | None = None
    cpu: bool = False
    gpus: tuple[int, ...] | None = None
    threads: int | None = None
    timeout: float = 120.0
    launcher: str | None = None
    profile: str | None = None
    connect: str | None = None
    ip: str = "127.0.0.1"
    start_method: str = "fork"
    group_timeout: float = 1800.0
    check_collectives: bool = False
    launch_options: Mapping[str, object] | None = None
    launch: LaunchPlan | None = None
    controller_gone_s: float | None = None


# -- a magic's words ---------------------------------------------------------------------


def parse_gpu_list(text: str) -> list[int]:
    """'0,1,3' -> [0, 1, 3]; rejects anything else with the value in the message."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not is_digits(p) for p in parts):
        raise PlacementError(
            f"--gpus {text!r} is not a list of GPU indices: write it like --gpus 0,1,2"
        )
    gpus = [int(p) for p in parts]
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"--gpus {text!r} names a GPU twice: list each GPU once")
    return gpus


def parse_launch_options(items: list[str] | None) -> dict[str, str]:
    """['partition=gpu', 'time=1:00:00'] (from repeated --launch-opt) -> a dict.

    A value with spaces is quoted whole in the magic's line, ``--launch-opt
    "mpi_args=--bind-to none"`` (the magics take off the quotes around a whole word);
    an item that still holds its quotes has them taken off here, as a quoted value
    (``ssh_args="-p 2222"`` in a list given from Python) has.
    """
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = _unquote(item).partition("=")
        if not sep or not key.strip():
            raise PlacementError(
                f"launcher option {item!r}: write it as KEY=VALUE, e.g. partition=gpu"
            )
        out[key.strip().replace("-", "_")] = _unquote(value.strip())
    return out


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


# -- where the processes go ----------------------------------------------------------------


def _check_where(ip, launcher, profile, connect) -> None:
    if isinstance(ip, str) and _ipv6(ip):
        # ipyparallel's controller binds tcp://ADDR:PORT without zmq's IPv6 switch: it
        # crashed on '::1' (ZMQError: No such device) after the start began.
        raise PlacementError(
            f"--ip {ip!r} is an IPv6 address, and the controller listens on IPv4 only: give an "
            "IPv4 address, e.g. 127.0.0.1 (the default) or this host's IPv4 address on the "
            "network the ranks share (`hostname -I` lists them)"
        )
    if not isinstance(ip, str) or not _bindable(ip):
        raise PlacementError(
            f"--ip {ip!r} is not an IP address or a host name of this machine: give e.g. "
            "127.0.0.1 (the default, this machine only) or this host's address on the network "
            "the ranks share"
        )
    if launcher is not None and not isinstance(launcher, type):
        _check_launcher(str(launcher))
    if profile is not None:
        from IPython.core.profiledir import ProfileDir, ProfileDirError
        from IPython.paths import get_ipython_dir

        try:
            ProfileDir.find_profile_dir_by_name(get_ipython_dir(), str(profile))
        except ProfileDirError:
            raise PlacementError(
                f"--profile {profile!r}: no such IPython profile in {get_ipython_dir()}; create "
                f"it with `ipython profile create --parallel {profile}`, or leave --profile out"
            ) from None
    if connect is not None and not os.path.isfile(os.path.expanduser(str(connect))):
        raise PlacementError(
            f"--connect {connect!r}: no such file. Pass the cluster file (cluster-*.json) or the "
            "client connection file (ipcontroller-client.json) of a running ipyparallel cluster"
        )


def _ipv6(ip: str) -> bool:
    """An IPv6 address, or a host name that resolves to IPv6 addresses only."""
    try:
        return ipaddress.ip_address(ip).version == 6
    except ValueError:
        pass
    if len(ip) > 253 or not _HOSTNAME.fullmatch(ip):
        return False
    try:
        families = {info[0] for info in socket.getaddrinfo(ip, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return families == {socket.AF_INET6}


def _bindable(ip: str) -> bool:
    """An IP address or host name that this machine can bind (the controller listens there)."""
    try:
        addresses = [str(ipaddress.ip_address(ip))]
    except ValueError:
        if len(ip) > 253 or not _HOSTNAME.fullmatch(ip):
            return False
        try:
            infos = socket.getaddrinfo(ip, None, socket.AF_INET, socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        addresses = [info[4][0] for info in infos]
    # An address of another machine ("1.2.3" resolves, as 1.2.0.3) would only fail
    # after the processes started; a bind tells now.
    for address in addresses:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def _check_launcher(name: str) -> None:
    from ipyparallel.cluster.launcher import BaseLauncher, find_launcher_class

    try:
        if "." in name:  # a class by import path, as ipyparallel accepts
            from traitlets.utils.importstring import import_item

            found = import_item(name)
        else:
            found = find_launcher_class(name, "engine")
        if not (isinstance(found, type) and issubclass(found, BaseLauncher)):
            raise ValueError(name)  # importable, but not a launcher (os.path, a function)
    except (KeyError, ImportError, ValueError, AttributeError):
        from importlib.metadata import entry_points

        known = sorted({ep.name for ep in entry_points(group="ipyparallel.engine_launchers")})
        raise PlacementError(
            f"--launcher {name!r} is not an ipyparallel engine launcher: use one of "
            f"{', '.join(known)} (or a launcher class as module.Class)"
        ) from None


# -- all of them ---------------------------------------------------------------------------


def check_start_options(requested: StartOptions) -> StartOptions:
    """Check every option of a start (see :class:`~nbdist.DistSession`); the checked options.

    ``requested.launch_options`` (Slurm/SSH/MPI options) become ``launch``, the
    launcher's plan. Raises :class:`~nbdist.errors.PlacementError` naming the
    value and the fix. What depends on the devices (``--gpus`` beyond those
    visible, ``nccl`` without GPUs) is checked by the placement planner, which sees them.
    """
    o = requested
    check_count(o.n)
    check_threads(o.threads)
    gpus = o.gpus
    if gpus is not None and (
        isinstance(gpus, (str, bytes)) or not all(is_whole(g) and g >= 0 for g in gpus)
    ):
        raise PlacementError(f"gpus {gpus!r}: give GPU indices, e.g. [0, 1]")
    if not isinstance(o.cpu, bool) and o.cpu not in (0, 1):
        # cpu="no" would be true: a string from a config file must not start CPU ranks.
        raise PlacementError(f"cpu {o.cpu!r}: give True (CPU ranks, gloo) or False")
    if not isinstance(o.check_collectives, bool):
        raise PlacementError(
            f"check_collectives {o.check_collectives!r}: give True (each collective compared "
            "across the ranks before it runs) or False"
        )
    if o.start_method not in START_METHODS:
        raise PlacementError(f"start_method {o.start_method!r}: use 'fork' or 'spawn'")
    if o.connect and (o.launcher or o.profile):
        raise PlacementError("--connect uses a running cluster: leave out --launcher/--profile")
    _check_where(o.ip, o.launcher, o.profile, o.connect)
    if not o.connect and o.launcher is not None:
        _check_launched(o.launcher, gpus, o.start_method)
    launch = None
    if not o.connect and (o.launch_options or str(o.launcher).lower() in LAUNCHERS):
        launch = plan_launch(o.launcher, o.n, ip=o.ip, **dict(o.launch_options or {}))
    launched = not o.connect and (o.launcher is not None or launch is not None)
    group_timeout = check_seconds(o.group_timeout, "group_timeout")
    if group_timeout < MIN_GROUP_TIMEOUT_S:
        raise PlacementError(
            f"group_timeout {o.group_timeout!r} is too short: it bounds the group's forming "
            "too (each rank connects to rank 0's store, then a first collective), which can take "
            f"over a second on a busy machine; give at least {MIN_GROUP_TIMEOUT_S:g} s "
            "(default 1800)"
        )
    check_output_settings()
    return dataclasses.replace(
        o,
        cpu=bool(o.cpu),
        gpus=tuple(gpus) if gpus else None,
        timeout=check_seconds(o.timeout, "timeout"),
        group_timeout=group_timeout,
        launch=launch,
        controller_gone_s=controller_gone_seconds() if launched else None,
    )


def _check_launched(launcher, gpus, start_method) -> None:
    """Refuse what only nbdist's own engines (no --launcher) take: --gpus, --spawn."""
    name = getattr(launcher, "__name__", str(launcher))
    if gpus:
        where = {
            "slurm": "--launch-opt gpus_per_node=K (one rank per GPU)",
            "ssh": "hosts=node1:K (K ranks per host, one per GPU)",
            "mpi": "hosts=node1:K (K ranks per host, one per GPU)",
        }.get(name.lower(), "an ipyparallel profile (--profile)")
        raise PlacementError(
            f"--gpus {','.join(map(str, gpus))} picks GPUs for engines nbdist starts itself; "
            f"with --launcher {name} each rank uses cuda:<its local rank> of the GPUs its host "
            f"shows: leave --gpus out, and set the GPUs per host with {where}"
        )
    if start_method == "spawn":
        raise PlacementError(
            f"--spawn picks how nbdist's own engines start; --launcher {name} starts each "
            "engine as a process of its own already: leave --spawn out"
        )


def controller_gone_seconds() -> float:
    """``NBDIST_CONTROLLER_GONE_S`` (seconds; unset: 30): see :mod:`nbdist.engine.controller_watch`."""
    value = os.environ.get("NBDIST_CONTROLLER_GONE_S", "").strip()
    if not value:
        return DEFAULT_GONE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise PlacementError(
            f"NBDIST_CONTROLLER_GONE_S={value!r}: give a number of seconds above 0, "
            f"e.g. 60, or unset it (default {DEFAULT_GONE_S:g})"
        )
    return seconds


# How much of each rank's output a cell shows: read by the driver at each cell
# (nbdist.driver.output_fold.lines_per_rank, nbdist.driver.rank_streams.output_limit), checked
# here so that a bad value is refused before the ranks start, not at the first cell.
_OUTPUT_SETTINGS = {
    "NBDIST_OUTPUT_LINES": ("lines of each rank a cell's folded output keeps", "1000"),
    "NBDIST_OUTPUT_LIMIT": ("characters of each rank's stdout (or stderr) a cell shows", "1048576"),
}


def check_output_settings() -> None:
    """Refuse an ``NBDIST_OUTPUT_LINES`` / ``NBDIST_OUTPUT_LIMIT`` that is not a count >= 0."""
    for name, (what, example) in _OUTPUT_SETTINGS.items():
        value = os.environ.get(name, "").strip()
        if value and not is_digits(value):
            raise PlacementError(
                f"{name}={value!r}: give the {what} as a whole number, 0 for all "
                f"(e.g. {name}={example}), or unset it"
            )
