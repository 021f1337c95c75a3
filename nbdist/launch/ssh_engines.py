"""Kernel side, starting separate processes: engines over SSH, each host checked first.

:func:`check_hosts` logs in to every host once, in parallel, before anything
starts, and runs the remote interpreter on an import of nbdist, ipyparallel and
torch: a host that cannot be reached, a login SSH refuses, a missing
interpreter or package is a :class:`~nbdist.errors.PlacementError` naming the
host, SSH's or Python's own words and the fix, and nothing was started.

:class:`SSHEngines` is ipyparallel's SSH engine launcher with three changes:
SSH never prompts (``BatchMode``: a password prompt would hang the kernel);
each host gets its own profile directory under ``/tmp`` (on this machine the
notebook's own would otherwise be copied onto itself), removed at stop; scp
gets the options of ``ssh_args`` that it understands; and stop takes one
login per host.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from ipyparallel.cluster.launcher import SSHEngineLauncher, SSHEngineSetLauncher
from traitlets import default

from nbdist.errors import PlacementError

__all__ = ["SSH_OPTIONS", "SSHEngines", "check_hosts", "scp_args_for"]

# Never prompt (the kernel has no terminal); give up on a dead host after 10 s.
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
_MARK = "--nbdist-engine-output--"
_PROBE = "import nbdist, ipyparallel, torch; print('nbdist-ok')"


def scp_args_for(ssh_args: Sequence[str]) -> list[str]:
    """The options of ``ssh_args`` that scp takes too (``-p PORT`` becomes ``-P PORT``).

    Example::

        >>> scp_args_for(["-F", "cfg", "-p", "2222", "-A"])
        ['-F', 'cfg', '-P', '2222']
    """
    out: list[str] = []
    args = list(ssh_args)
    for i, arg in enumerate(args):
        if arg in ("-F", "-i", "-o", "-J") and i + 1 < len(args):
            out += [arg, args[i + 1]]
        elif arg == "-p" and i + 1 < len(args):
            out += ["-P", args[i + 1]]
    return out


def _split(host: str) -> tuple[str, list[str]]:
    """'user@host:2222' -> ('user@host', ['-p', '2222']) (ipyparallel's host:port form)."""
    if host.count(":") == 1:
        name, port = host.split(":")
        if port.isdigit():
            return name, ["-p", port]
    return host, []


def _check_one(host: str, python: str, ssh_args: Sequence[str]) -> str:
    """'' if ``host`` runs ``python`` with nbdist importable, else what went wrong."""
    name, port = _split(host)
    command = ["ssh", *SSH_OPTIONS, *port, *ssh_args, name, python, "-c", f'"{_PROBE}"']
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return "no `ssh` client on this machine's PATH: install openssh-client"
    except subprocess.TimeoutExpired:
        return f"host {host}: no answer over SSH within 60 s (`{' '.join(command)}`)"
    if result.returncode == 0 and "nbdist-ok" in result.stdout:
        return ""
    said = " ".join(line.strip() for line in result.stderr.strip().splitlines()[-3:])
    if result.returncode == 255:
        if "Permission denied" in said or "Authentication" in said:
            fix = (
                "set up key-based login for this user (ssh-copy-id), or name the key in "
                "ssh_args='-i KEY'; nbdist never types a password"
            )
            return f"host {host}: SSH refused the login ({said}): {fix}"
        if "Host key verification failed" in said:
            return (
                f"host {host}: SSH does not know its host key ({said}): connect once with "
                f"`ssh {name}` and accept the key"
            )
        return (
            f"host {host} cannot be reached over SSH ({said}): check the name, that sshd "
            "runs there, and the port (ssh_args='-p PORT')"
        )
    if result.returncode == 127 or "No such file" in said or "not found" in said:
        return (
            f"host {host} has no Python at {python!r} ({said}): pass the interpreter of the "
            "environment there, e.g. --launch-opt python=/opt/envs/train/bin/python"
        )
    return (
        f"host {host}: {python} cannot import nbdist, ipyparallel and torch ({said}): install "
        "the notebook's environment there (same versions), or pass its interpreter as python=..."
    )


def check_hosts(hosts: Mapping[str, int], *, python: str, ssh_args: Sequence[str] = ()) -> None:
    """Log in to every host (in parallel) and import nbdist there; PlacementError if one fails."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        found = list(pool.map(lambda h: _check_one(h, python, ssh_args), hosts))
    problems = [p for p in found if p]
    if problems:
        raise PlacementError("--launcher ssh: " + "; ".join(problems) + ". Nothing was started")


class SSHEngine(SSHEngineLauncher):
    """One engine over SSH, run by the notebook's interpreter path unless told otherwise."""

    final_output: str | None = None  # read by SSHEngines.stop, before the directory went

    def get_output(self, remove=False):
        """The engine's output (fetched over SSH, or as read when it was stopped)."""
        if self.final_output is not None:
            return self.final_output
        return super().get_output(remove=remove)

    @default("remote_python")
    def _remote_python_default(self):
        return sys.executable  # the same environment at the same path, as docs/multihost.md says

    @property
    def ssh_sender(self):
        """ipyparallel's SSH command sender, its profile creation kept out of the cell.

        ``IPython profile create`` over SSH prints "[ProfileCreate] Generating default
        config file" twice per engine on its stderr, which the kernel shows in the cell;
        it goes to the captured output instead (still in the error if the creation fails).
        """
        sender = super().ssh_sender
        run = sender.check_output_python_module
        if not getattr(run, "nbdist_quiet", False):

            def quiet(module_params, **kwargs):
                if list(module_params)[:3] == ["IPython", "profile", "create"]:
                    kwargs.setdefault("stderr", subprocess.STDOUT)
                return run(module_params, **kwargs)

            quiet.nbdist_quiet = True
            sender.check_output_python_module = quiet
        return sender


class SSHEngines(SSHEngineSetLauncher):
    """ipyparallel's SSH engine-set launcher with :class:`SSHEngine` and non-prompting SSH."""

    launcher_class = SSHEngine

    @default("remote_python")
    def _remote_python_default(self):
        return sys.executable

    def __init__(self, *args, **kwargs):
        """As ipyparallel's; SSH_OPTIONS go before the configured ``ssh_args``."""
        super().__init__(*args, **kwargs)
        if "BatchMode=yes" not in self.ssh_args:
            self.ssh_args = [*SSH_OPTIONS, *self.ssh_args]
        if not self.scp_args:
            self.scp_args = scp_args_for(self.ssh_args)

    def start(self, n):
        """Start the engines; each host's profile directory is ``/tmp/nbdist-ssh-<cluster id>``."""
        # ipyparallel's default is the local path (less the home directory): on
        # this machine, the notebook's own profile directory, copied onto itself.
        self.remote_profile_dir = f"/tmp/nbdist-ssh-{self.cluster_id}"
        return super().start(n)

    async def stop(self):
        """Stop the engines: one login per host ends them and removes the profile directory.

        SIGTERM, up to 5 s to exit, then SIGKILL; their output is read in the
        same login. (ipyparallel's own stop takes several logins per engine,
        each starting a Python there.)
        """
        by_host: dict[str, list[SSHEngine]] = {}
        for engine in self.launchers.values():
            if engine.state == "running" and engine.pid:
                by_host.setdefault(engine.location, []).append(engine)
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(by_host)))) as pool:
            list(pool.map(lambda item: self._stop_host(*item), by_host.items()))

    def _stop_host(self, location: str, engines: list[SSHEngine]) -> None:
        pids = " ".join(str(int(e.pid)) for e in engines)
        outputs = " ".join(shlex.quote(e.remote_output_file) for e in engines)
        script = (
            f"kill -TERM {pids} 2>/dev/null; for i in $(seq 50); do "
            f"kill -0 {pids} 2>/dev/null || break; sleep 0.1; done; kill -KILL {pids} 2>/dev/null; "
            f'for f in {outputs}; do echo {_MARK}; cat "$f" 2>/dev/null; done; '
            f"rm -rf {shlex.quote(self.remote_profile_dir)}"
        )
        try:
            result = subprocess.run(
                [*self.ssh_cmd, *self.ssh_args, location, script],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            texts = result.stdout.split(_MARK + "\n")[1:]
        except (OSError, subprocess.TimeoutExpired):  # the host is gone: so are its engines
            texts = []
        for engine, text in zip(engines, texts + [""] * len(engines)):
            engine.final_output = text
