"""Real launchers for the tests of tests/cluster: a running Slurm, Open MPI, an sshd on loopback.

Slurm: the one-node cluster of ``scripts/slurm_local.sh start`` (.ci/run starts
it); the Slurm tests are skipped, saying so, where no cluster answers. The
sshd is started here, per module, on a loopback port with keys made for the
test, and stopped by its PID.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import wait_gone

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Rank 1 dies of a segmentation fault on line 3; rank 0 waits in the collective for it.
SEGFAULT_CELL = (
    "import ctypes\nif rank == 1:\n    ctypes.string_at(0)\ndist.all_reduce(torch.ones(1))\n"
)


def squeue() -> list[tuple[str, str, str, str]]:
    """Every job Slurm lists: (id, name, state, reason)."""
    out = subprocess.run(
        ["squeue", "-h", "-o", "%i|%j|%T|%r"], capture_output=True, text=True, check=True
    ).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]


def _slurm_answers() -> bool:
    if shutil.which("sinfo") is None:
        return False
    result = subprocess.run(
        ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30, check=False
    )
    return result.returncode == 0 and any(
        s.strip("*~#") in ("idle", "mix", "alloc") for s in result.stdout.split()
    )


@pytest.fixture(scope="session")
def slurm():
    """A running Slurm cluster whose nodes are this machine, with nothing queued."""
    if not _slurm_answers():
        pytest.skip("no Slurm cluster answers: `bash scripts/slurm_local.sh start` runs one")
    from nbdist.launch.slurm_job import nodes_here

    if not nodes_here(None):
        pytest.skip("Slurm's nodes are other machines: these tests need a one-node cluster")
    if squeue():
        pytest.skip(f"Slurm has jobs queued already ({squeue()}): these tests need it empty")
    return True


def gone(pids, timeout: float = 30.0) -> list[int]:
    """Those of ``pids`` still running after ``timeout`` s (zombies count as gone)."""
    return wait_gone(pids, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sshd:
    """An sshd on 127.0.0.1, a key pair for this test, and an ssh config naming them."""

    def __init__(self, root: str) -> None:
        """Make the keys and configs under ``root`` and start sshd on a free loopback port."""
        self.root = root
        self.port = free_port()
        host_key = os.path.join(root, "host_ed25519")
        self.key = os.path.join(root, "client_ed25519")
        self.other_key = os.path.join(root, "stranger_ed25519")  # never authorized
        for path in (host_key, self.key, self.other_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
        authorized = os.path.join(root, "authorized_keys")
        shutil.copy(self.key + ".pub", authorized)
        sshd_config = os.path.join(root, "sshd_config")
        with open(sshd_config, "w") as f:
            f.write(
                f"ListenAddress 127.0.0.1\nPort {self.port}\nHostKey {host_key}\n"
                f"AuthorizedKeysFile {authorized}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                "PermitRootLogin prohibit-password\nPidFile none\n"
                f"Subsystem sftp {_sftp_server()}\n"
            )
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        self.log = os.path.join(root, "sshd.log")
        self.process = subprocess.Popen(
            [shutil.which("sshd") or "/usr/sbin/sshd", "-D", "-e", "-f", sshd_config],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"),  # noqa: SIM115 - the child keeps it
        )
        self.config = self.client_config("nbdist-ssh-test", self.key)
        self._wait_listening()

    def client_config(self, alias: str, key: str, port: int | None = None) -> str:
        """An ssh config file: ``alias`` is this sshd (or ``port``), logging in with ``key``."""
        path = os.path.join(self.root, f"ssh_config_{alias}")
        with open(path, "w") as f:
            f.write(
                f"Host {alias}\n  HostName 127.0.0.1\n  Port {port or self.port}\n"
                f"  IdentityFile {key}\n  IdentitiesOnly yes\n  UserKnownHostsFile /dev/null\n"
                "  StrictHostKeyChecking no\n  LogLevel ERROR\n"
            )
        return path

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sshd exited: {open(self.log).read()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("sshd did not listen within 30 s")

    def stop(self) -> None:
        """SIGTERM sshd (by PID), then wait; its sessions end with it."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _sftp_server() -> str:
    for path in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server"):
        if os.path.exists(path):
            return path
    return "internal-sftp"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """A running :class:`Sshd` (skipped without openssh-server and -client)."""
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("no sshd: apt-get install openssh-server (.ci/run does)")
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("no ssh client: apt-get install openssh-client")
    server = Sshd(str(tmp_path_factory.mktemp("sshd")))
    yield server
    server.stop()


def python() -> str:
    """The interpreter the engines run (this environment's)."""
    return sys.executable


def own_pid_namespace_unavailable() -> str | None:
    """Why a process cannot get a PID namespace of its own here (root, util-linux), or None."""
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux)"
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, text=True
    )
    return f"`unshare --pid` failed: {probe.stderr.strip()}" if probe.returncode else None


def python_in_own_pid_namespace(folder) -> str:
    """An interpreter for ``python=`` whose engines each run in a PID namespace of their own.

    As on another machine or in a container: an engine is PID 1 there, and PID 1 here is
    this machine's init. Only the engine: ipyparallel's SSH helper starts it in the
    background and exits, which would end a namespace it were the first process of.
    """
    wrapper = os.path.join(str(folder), "python-in-its-own-pid-namespace")
    with open(wrapper, "w") as f:
        f.write(
            "#!/bin/sh\n"
            'case "$1 $2" in "-m ipyparallel.engine"*)\n'
            f'  exec unshare --pid --fork --kill-child --mount-proc {python()} "$@";;\n'
            "esac\n"
            f'exec {python()} "$@"\n'
        )
    os.chmod(wrapper, 0o755)
    return wrapper


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: starts real Slurm jobs, mpiexec, an sshd, or named sessions with real kernels "
        "(seconds each; in CI)",
    )
