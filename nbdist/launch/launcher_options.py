"""Kernel side, before anything starts: Slurm, SSH and MPI options, checked and made launcher config.

nbdist does not manage clusters itself: ipyparallel's launchers start the
engines (an ``sbatch`` job, ``ssh`` to each host, ``mpiexec``) and its
controller stays here, in the notebook's machine. :func:`plan_launch` turns
the few options a user gives (partition, time, account, hosts, ...) into that
launcher's traitlets configuration, checked first. It asks nothing of the
cluster but where its hosts are (``sinfo``, ``ssh -G``: no job, no login).

Engines on other hosts must reach the controller, so these launchers need
``--ip``: an address of this machine on the cluster's network. Loopback is
refused with that fix, unless every engine runs on this machine (a one-node
Slurm cluster, ``ssh localhost``); nothing listens beyond loopback unless asked.

Example::

    >>> plan = plan_launch("slurm", 16, ip="10.1.0.5", partition="gpu", time="01:00:00")
    >>> plan.engine_launcher, plan.n
    ('slurm', 16)
    >>> print(plan.config["SlurmEngineSetLauncher"]["batch_template"])  # doctest: +ELLIPSIS
    #!/bin/sh
    ...
    #SBATCH --partition=gpu
    ...
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from nbdist.engine.netif import is_loopback
from nbdist.errors import PlacementError
from nbdist.launch.batch_task_engine import NO_SELF_SHUTDOWN
from nbdist.launch.values import check_count, is_digits, is_whole

__all__ = ["LAUNCHERS", "LaunchPlan", "parse_hosts", "plan_launch"]

# The launchers nbdist documents and checks; others pass through to ipyparallel unchecked.
LAUNCHERS = ("slurm", "ssh", "mpi")
_SLURM_TIME = re.compile(
    r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$"
)
_SAFE = re.compile(r"^[A-Za-z0-9_.,:@=+/\-]+$")
_LAUNCHER_OPTIONS = {
    "slurm": (
        "partition",
        "time",
        "account",
        "qos",
        "nodes",
        "gpus_per_node",
        "cpus_per_task",
        "sbatch",
    ),
    "ssh": ("hosts", "python", "ssh_args"),
    "mpi": ("hosts", "mpi_args", "mpi_cmd", "python"),
}


_MAX_COUNT_DIGITS = 9
# mpiexec options that put ranks on other hosts (Open MPI's and MPICH's spellings).
_MPI_HOST_FLAGS = {
    "--host",
    "-host",
    "-H",
    "--hostfile",
    "-hostfile",
    "--machinefile",
    "-machinefile",
    "-f",
    "--default-hostfile",
}


# mpiexec options that set the number of processes: nbdist gives it (-n N) from the rank count.
_MPI_COUNT_FLAGS = {"-n", "-np", "--np", "--n", "-c"}
# sbatch options that would override the job nbdist writes: the nbdist option to use instead.
_RANKS = "give the number of ranks as N (%dist_start N)"
_OUTPUT = "leave it out: nbdist places the job's output and errors, to show them if a start fails"
_SBATCH_OWN = {
    "--ntasks": _RANKS,
    "-n": _RANKS,
    "--ntasks-per-node": "use gpus_per_node=K (K ranks, one per GPU, on each node)",
    "--nodes": "use nodes=K",
    "-N": "use nodes=K",
    "--export": "leave it out: nbdist exports the notebook's environment (--export=ALL)",
    "--job-name": "leave it out: nbdist names the job after the cluster, to find it again",
    "-J": "leave it out: nbdist names the job after the cluster, to find it again",
    "--output": _OUTPUT,
    "-o": _OUTPUT,
    "--error": _OUTPUT,
    "-e": _OUTPUT,
    "--partition": "use partition=NAME",
    "--time": "use time=HH:MM:SS",
    "--account": "use account=NAME",
    "--qos": "use qos=NAME",
    "--gpus-per-node": "use gpus_per_node=K",
    "--cpus-per-task": "use cpus_per_task=K",
}


@dataclass(frozen=True)
class LaunchPlan:
    """What to hand ipyparallel: the engine launcher's name, ``n``, and config by class."""

    engine_launcher: str
    n: int
    config: dict = field(default_factory=dict)  # {"SlurmEngineSetLauncher": {"queue": ...}}
    here: bool = False  # every engine runs on this machine: its limits hold them all


def _slurm(n: int, opts: dict) -> dict:
    lines = [
        "#!/bin/sh",
        "#SBATCH --export=ALL",
        "#SBATCH --job-name=ipengine-{cluster_id}",
        "#SBATCH --ntasks={n}",
    ]
    for name in ("partition", "account", "qos", "time"):
        if opts.get(name):
            lines.append(f"#SBATCH --{name}={opts[name]}")
    per_node = opts.get("gpus_per_node")
    if per_node is not None:
        # One engine per GPU, each seeing all of its node's GPUs, as torchrun's workers
        # do: a rank uses cuda:<local rank> (nbdist sets the device when it attaches).
        lines += [f"#SBATCH --ntasks-per-node={per_node}", f"#SBATCH --gpus-per-node={per_node}"]
    if opts.get("nodes") is not None:
        lines.append(f"#SBATCH --nodes={opts['nodes']}")
    if opts.get("cpus_per_task"):
        lines.append(f"#SBATCH --cpus-per-task={opts['cpus_per_task']}")
    if opts.get("output_here"):  # the nodes are this machine: they can write the profile's log
        lines.append("#SBATCH --output={output_file}")
    lines += [f"#SBATCH {extra}" for extra in opts.get("sbatch", [])]
    lines.append("srun {program_and_args}")
    return {"SlurmEngineSetLauncher": {"batch_template": "\n".join(lines) + "\n"}}


def _ssh(opts: dict) -> dict:
    # ipyparallel's own engine command, its nanny included (it reports how an engine ended).
    config: dict = {"engines": dict(opts["hosts"]), "engine_args": [NO_SELF_SHUTDOWN]}
    if opts.get("python"):
        config["remote_python"] = opts["python"]
    if opts.get("ssh_args"):
        config["ssh_args"] = list(opts["ssh_args"])
    return {"SSHEngineSetLauncher": config}


def _mpi(opts: dict) -> dict:
    config: dict = {}
    args: list[str] = []
    if opts.get("hosts"):
        args += ["--host", ",".join(f"{h}:{c}" for h, c in opts["hosts"].items())]
    args += list(opts.get("mpi_args", []))
    if args:
        config["mpi_args"] = args
    if opts.get("mpi_cmd"):
        config["mpi_cmd"] = list(opts["mpi_cmd"])
    if opts.get("python"):  # the interpreter on every host (default: the notebook's path)
        config["engine_cmd"] = [opts["python"], "-m", "nbdist.launch.batch_task_engine"]
    return {"MPIEngineSetLauncher": config}


def _launch_plan(launcher: str, n: int, opts: dict, here: bool = False) -> LaunchPlan:
    builders = {
        "slurm": lambda: _slurm(n, opts),
        "ssh": lambda: _ssh(opts),
        "mpi": lambda: _mpi(opts),
    }
    build = builders.get(launcher)
    return LaunchPlan(launcher, n, build() if build is not None else {}, here=here)


# -- checks --------------------------------------------------------------------------------


def parse_hosts(text: str | Mapping[str, int]) -> dict[str, int]:
    """'node1:4,node2:4' (or {'node1': 4}) -> {'node1': 4, 'node2': 4}; a bare host means 1.

    Each host once; IPv6 literals are refused (the controller listens on IPv4, and
    ``host:ranks`` cannot tell an IPv6 address's colons from the count's).
    """
    if isinstance(text, Mapping):
        items = [(str(h), c) for h, c in text.items()]
    else:
        items = [_host_item(text, part.strip()) for part in str(text).split(",") if part.strip()]
    hosts: dict[str, int] = {}
    for host, count in items:
        if not _SAFE.match(host) or not is_whole(count) or count < 1:
            raise PlacementError(
                f"hosts: {host!r} with {count!r} ranks is not usable: give a host name "
                "(or user@host) and a whole number of ranks >= 1, e.g. node1:4"
            )
        if host in hosts:
            raise PlacementError(
                f"hosts {text!r} names {host!r} twice: give each host once, with all its "
                f"ranks, e.g. {host}:{hosts[host] + count}"
            )
        hosts[host] = count
    if not hosts:
        raise PlacementError(f"hosts {text!r} names no host: write them like node1:4,node2:4")
    _check_capacity(sum(hosts.values()), text)
    return hosts


def _host_item(text, part: str) -> tuple[str, int]:
    """One 'host:ranks' of a hosts list (a bare host: 1 rank)."""
    bare = part.strip("[]").rpartition("]")[0] if part.startswith("[") else part
    for candidate in (bare, part.rpartition(":")[0].strip("[]"), part.strip("[]")):
        try:
            ipaddress.IPv6Address(candidate)
        except ValueError:
            continue
        raise PlacementError(
            f"hosts: {part!r} is an IPv6 address, which nbdist's launchers do not take (the "
            "controller listens on IPv4): name the host by its host name or IPv4 address, "
            "e.g. node1:4 or 10.1.0.7:4"
        )
    if part.count(":") > 1:
        raise PlacementError(
            f"hosts {text!r}: {part!r} has more than one ':': write each host as host:ranks, "
            "e.g. node1:4,node2:4"
        )
    host, _, count = part.rpartition(":") if ":" in part else (part, "", "1")
    if not host or not is_digits(count):
        raise PlacementError(
            f"hosts {text!r}: write them like node1:4,node2:4 (host:ranks), got {part!r}"
        )
    if len(count) > _MAX_COUNT_DIGITS:  # int() of thousands of digits fails; none would fit
        raise PlacementError(
            f"hosts: {host!r} with {count[:12]}{'...' if len(count) > 12 else ''} ranks is "
            "beyond what any machine's limits hold: give the ranks to start there, e.g. "
            f"{host}:4"
        )
    return host, int(count)


def _check_capacity(total: int, text) -> None:
    """Refuse a rank count this machine's limits could not hold (the kernel and the
    controller keep files per rank wherever the ranks run), as a start would."""
    from nbdist.launch import capacity

    needs = capacity.needs_for(total, local=0, rank0_local=False, fds_open=0)
    found = capacity.problems(needs, capacity.current_limits())
    if found:
        raise PlacementError(f"hosts: {total} ranks in all are too many here: {found[0]}")


def _slurm_here(partition: str | None) -> bool:
    """Whether a controller on loopback will do: Slurm's nodes are all this machine."""
    if shutil.which("sinfo") is None:
        return False
    from nbdist.launch.slurm_job import loopback_will_do

    return loopback_will_do(partition)


def _hosts_here(hosts, ssh_args=None) -> bool:
    from nbdist.launch.hosts import is_this_machine, ssh_hostname

    if ssh_args is None:
        return all(is_this_machine(h) for h in hosts)
    return all(is_this_machine(ssh_hostname(h, ssh_args)) for h in hosts)


def _check_remote_ip(launcher: str, ip: str, *, here: bool = False) -> None:
    """Engines on other hosts dial ``ip``: it must not be loopback (unless ``here``:
    every engine runs on this machine)."""
    if here and is_loopback(ip):
        return
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        try:  # a host name: what it resolves to is what the engines will dial
            address = ipaddress.ip_address(socket.gethostbyname(ip))
        except (OSError, ValueError):
            raise PlacementError(
                f"--ip {ip!r} is not an IP address (nor a host name that resolves): give this "
                "machine's address on the cluster network, e.g. --ip 10.1.0.5"
            ) from None
    if address.is_loopback:
        raise PlacementError(
            f"--launcher {launcher} starts engines on other hosts, which cannot reach a "
            f"controller on {ip}: pass --ip with this machine's address on the cluster "
            "network (e.g. --ip 10.1.0.5; `hostname -I` lists them)"
        )


def _word(name: str, value) -> str:
    text = str(value)
    if not _SAFE.match(text):
        raise PlacementError(
            f"{name} {text!r} has characters a batch script would misread: use letters, "
            "digits and . , : - _ / = + @ only"
        )
    return text


def _whole(name: str, value) -> int:
    text = str(value)
    if not is_digits(text) or int(text) < 1:
        raise PlacementError(f"{name} {text!r}: give a whole number >= 1")
    return int(text)


def _check_slurm(n: int | None, opts: dict) -> dict:
    if n is None:
        raise PlacementError(
            "--launcher slurm needs the number of ranks, e.g. %dist_start 16 --launcher slurm"
        )
    out = {k: _word(k, opts[k]) for k in ("partition", "account", "qos") if opts.get(k)}
    if opts.get("time"):
        if not _SLURM_TIME.match(str(opts["time"])):
            raise PlacementError(
                f"time {opts['time']!r} is not a Slurm time limit: use minutes, HH:MM:SS or "
                "D-HH:MM:SS, e.g. time=01:00:00"
            )
        out["time"] = str(opts["time"])
    nodes = opts.get("nodes")
    if opts.get("gpus_per_node") is not None:
        per_node = out["gpus_per_node"] = _whole("gpus_per_node", opts["gpus_per_node"])
        if n % per_node:
            raise PlacementError(
                f"{n} ranks do not fill nodes of {per_node} GPUs: start a multiple of "
                f"{per_node} ranks (one per GPU), e.g. {per_node * max(1, n // per_node)}"
            )
        nodes = nodes if nodes is not None else n // per_node
    if nodes is not None:
        out["nodes"] = _whole("nodes", nodes)
        if out["nodes"] > n:
            raise PlacementError(f"nodes={nodes} is more than the {n} ranks: ask for <= {n} nodes")
    if opts.get("cpus_per_task"):
        out["cpus_per_task"] = _whole("cpus_per_task", opts["cpus_per_task"])
    extras = []
    for extra in shlex.split(str(opts.get("sbatch") or "")):
        own = _SBATCH_OWN.get(extra.split("=")[0])
        if own is not None:
            raise PlacementError(f"sbatch option {extra!r} sets what nbdist's job sets: {own}")
        if not extra.startswith("--"):
            raise PlacementError(f"sbatch option {extra!r}: give long options, e.g. --mem=64G")
        extras.append(_word("sbatch option", extra))
    out["sbatch"] = extras
    return out


def _hosts_total(n: int | None, hosts_text, agree: str) -> tuple[dict[str, int], int]:
    hosts = parse_hosts(hosts_text)
    total = sum(hosts.values())
    if n is not None and n != total:
        raise PlacementError(f"{n} ranks but the hosts list {total} ({hosts_text}): {agree}")
    return hosts, total


def _check_launcher_options(launcher, n: int | None, ip: str, options: Mapping) -> LaunchPlan:
    name = str(launcher).lower()
    opts = {k.replace("-", "_"): v for k, v in options.items() if v not in (None, "")}
    if name not in LAUNCHERS:
        if opts:
            raise PlacementError(
                f"launcher {launcher!r} takes no nbdist options ({', '.join(sorted(opts))}): "
                f"configure it in an ipyparallel profile (--profile), or use one of "
                f"{', '.join(LAUNCHERS)}"
            )
        if n is None:
            raise PlacementError(f"--launcher {launcher} needs the number of ranks, e.g. 8")
        return LaunchPlan(str(launcher), n, {})
    unknown = sorted(set(opts) - set(_LAUNCHER_OPTIONS[name]))
    if unknown:
        raise PlacementError(
            f"--launcher {name} has no option {unknown[0]!r}: its options are "
            f"{', '.join(_LAUNCHER_OPTIONS[name])}"
        )
    checked: dict = {}
    if name == "slurm":
        checked = _check_slurm(n, opts)
        # Loopback only where Slurm's nodes are this machine (sinfo says): then the
        # job's output can go to the session's private log directory as well.
        here = _slurm_here(checked.get("partition"))
        _check_remote_ip(name, ip, here=here)
        checked["output_here"] = here and is_loopback(ip)
    elif name == "ssh":
        if not opts.get("hosts"):
            raise PlacementError(
                "--launcher ssh needs the hosts and ranks on each: e.g. hosts=node1:4,node2:4"
            )
        checked["hosts"], n = _hosts_total(
            n, opts["hosts"], "make them agree, or leave out the number of ranks"
        )
        if opts.get("python"):
            checked["python"] = _word("python", opts["python"])
        if opts.get("ssh_args"):
            checked["ssh_args"] = shlex.split(str(opts["ssh_args"]))
        # `ssh -G` resolves the host as ssh will (aliases in ~/.ssh/config included).
        ssh_args = checked.get("ssh_args", [])
        here = _hosts_here(checked["hosts"], ssh_args)
        _check_remote_ip(name, ip, here=here)
    else:  # mpi: on this machine only (mpiexec without hosts) loopback is fine.
        if opts.get("hosts"):
            checked["hosts"], n = _hosts_total(n, opts["hosts"], "make them agree")
        mpi_args = shlex.split(str(opts.get("mpi_args") or ""))
        counted = [a for a in mpi_args if a.split("=")[0] in _MPI_COUNT_FLAGS]
        if counted:
            raise PlacementError(
                f"mpi_args {counted[0]!r} sets the number of processes, which nbdist gives "
                "mpiexec from the number of ranks: leave it out, and give the count as N "
                "(%dist_start N --launcher mpi)"
            )
        here = True  # mpiexec without hosts runs every rank here
        if opts.get("hosts") or any(a.split("=")[0] in _MPI_HOST_FLAGS for a in mpi_args):
            here = "hosts" in checked and _hosts_here(checked["hosts"])
            _check_remote_ip(name, ip, here=here)
        if opts.get("python"):
            checked["python"] = _word("python", opts["python"])
        if n is None:
            raise PlacementError("--launcher mpi needs the number of ranks, e.g. %dist_start 8")
        checked["mpi_args"] = mpi_args
        if opts.get("mpi_cmd"):
            checked["mpi_cmd"] = shlex.split(str(opts["mpi_cmd"]))
    return _launch_plan(name, n, checked, here)


def plan_launch(launcher: str, n: int | None, *, ip: str, **options) -> LaunchPlan:
    """Check ``options`` for ``launcher`` (slurm, ssh, mpi, or another ipyparallel launcher).

    slurm: partition, time, account, qos, nodes, gpus_per_node, cpus_per_task,
    sbatch (extra long options). ssh: hosts ('node1:4,node2:4'), python (the
    remote interpreter), ssh_args. mpi: hosts, mpi_args, mpi_cmd, python.
    """
    if launcher is None:
        raise PlacementError(
            f"launcher options ({', '.join(sorted(options))}) need a launcher: add "
            f"--launcher {' or '.join(LAUNCHERS)}"
        )
    check_count(n)
    return _check_launcher_options(launcher, n, ip, options)
