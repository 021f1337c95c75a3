"""A real JupyterLab server for the browser tests, isolated, and the processes it starts.

``start_lab`` runs ``python -m jupyterlab`` on a free loopback port with a random
token and its own JUPYTER_*_DIR / IPYTHONDIR / settings dirs, loading the nbdist
extension from the folder it is given; ``stop_lab`` shuts its kernels down through
the REST API, then the server, and reports any process it started (sampled while it
ran, so reparented ones count too) that is still alive.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.conftest import wait_gone

__all__ = [
    "LabServer",
    "TreeSampler",
    "free_port",
    "nbdist_extension_config",
    "start_lab",
    "stop_lab",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nbdist_extension_config() -> Path | None:
    """The installed config file enabling ``nbdist.server`` (hatch shared-data), if any."""
    conf_d = Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d"
    for path in sorted(conf_d.glob("*.json")):
        try:
            enabled = json.loads(path.read_text())["ServerApp"]["jpserver_extensions"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if enabled.get("nbdist.server"):
            return path
    return None


class TreeSampler(threading.Thread):
    """Records every descendant of one process, every 0.2 s, until stopped."""

    def __init__(self, pid: int):
        super().__init__(name="ui-process-sampler", daemon=True)
        self.root = psutil.Process(pid)
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create_time, cmdline)
        self._stop_event = threading.Event()

    def sample(self) -> None:
        try:
            children = self.root.children(recursive=True)
        except psutil.Error:
            return
        for child in children:
            if child.pid in self.seen:
                continue
            try:
                self.seen[child.pid] = (child.create_time(), " ".join(child.cmdline())[:160])
            except psutil.Error:
                pass

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            self.sample()

    def stop(self) -> None:
        self.sample()
        self._stop_event.set()
        self.join(5)

    def alive(self) -> list[int]:
        """Recorded PIDs that are still the same (non-zombie) process."""
        out = []
        for pid, (created, _) in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out


@dataclass
class LabServer:
    url: str  # base URL, ends with "/"
    token: str
    root_dir: Path
    proc: subprocess.Popen
    log_path: Path
    extension: str  # how nbdist.server was enabled (for the report)
    sampler: TreeSampler = field(repr=False)

    def api(self, method: str, path: str, body: dict | None = None, timeout: float = 10):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path.lstrip("/"),
            data=data,
            method=method,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.strip()[:1] in (b"{", b"[") else raw)

    def get(self, path: str, timeout: float = 10) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.url + path.lstrip("/"), headers={"Authorization": f"token {self.token}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, b""

    def kernels(self) -> list[dict]:
        status, body = self.get("api/kernels")
        return json.loads(body) if status == 200 else []

    def kernel_connected(self) -> bool:
        """A kernel is started, idle and connected to the page. The page shows "idle" before
        that, and a Run All clicked then is dropped: its cells never run."""
        return any(k["execution_state"] == "idle" and k["connections"] >= 1 for k in self.kernels())

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_lab(tmp: Path, root_dir: Path, log_path: Path, labextensions: Path) -> LabServer:
    env = dict(os.environ)
    dirs = {
        "JUPYTER_CONFIG_DIR": tmp / "config",
        "JUPYTER_DATA_DIR": tmp / "data",
        "JUPYTER_RUNTIME_DIR": tmp / "runtime",
        "IPYTHONDIR": tmp / "ipython",
    }
    for var, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")

    # No "news"/update pop-up: never fetch news, never check for updates.
    settings = tmp / "lab-user-settings"
    notif = settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notif.parent.mkdir(parents=True, exist_ok=True)
    notif.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))

    # The nbdist server extension is enabled by a config file the wheel installs into
    # {prefix}/etc/jupyter/jupyter_server_config.d; an editable install may lack it.
    # Then enable it the same way, from the isolated config dir.
    if importlib.util.find_spec("nbdist.server") is None:
        extension = "absent (no nbdist.server module)"
    elif (installed := nbdist_extension_config()) is not None:
        extension = f"enabled by {installed}"
    else:
        conf_d = dirs["JUPYTER_CONFIG_DIR"] / "jupyter_server_config.d"
        conf_d.mkdir(parents=True, exist_ok=True)
        (conf_d / "nbdist.json").write_text(
            json.dumps({"ServerApp": {"jpserver_extensions": {"nbdist.server": True}}})
        )
        extension = "enabled by the test (no installed config file in the venv)"

    port = free_port()
    token = secrets.token_hex(16)
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={tmp / 'lab-workspaces'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        # Searched before the venv's installed copy: the build under test, not the last install.
        f"--LabApp.extra_labextensions_path={labextensions}",
        # window.jupyterapp: tests run JupyterLab commands (change the theme) as a menu would.
        "--LabApp.expose_app_in_browser=True",
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the server
    proc = subprocess.Popen(cmd, env=env, cwd=root_dir, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    sampler = TreeSampler(proc.pid)
    sampler.start()
    server = LabServer(
        url=f"http://127.0.0.1:{port}/",
        token=token,
        root_dir=root_dir,
        proc=proc,
        log_path=log_path,
        extension=extension,
        sampler=sampler,
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            sampler.stop()
            pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if server.get("api/status", timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_lab(server)
            pytest.fail(f"jupyter lab did not answer within 60 s:\n{server.log_tail()}")
        time.sleep(0.2)


def stop_lab(server: LabServer) -> list[str]:
    """Kernels via REST, then the server (REST, then SIGTERM); returns leftover processes."""
    problems = []
    server.sampler.sample()
    if server.proc.poll() is None:
        for kernel in server.kernels():
            try:
                server.api("DELETE", f"api/kernels/{kernel['id']}", timeout=30)
            except OSError as exc:
                problems.append(f"could not shut down kernel {kernel['id']}: {exc}")
        try:
            server.api("POST", "api/shutdown", timeout=10)
        except OSError:
            pass
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            problems.append("jupyter lab ignored /api/shutdown; sent SIGTERM")
            server.proc.terminate()
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait(5)
    server.sampler.stop()
    still = wait_gone(server.sampler.alive(), timeout=20)
    for pid in still:
        problems.append(f"left behind: {pid} {server.sampler.seen[pid][1]}")
        try:
            psutil.Process(pid).kill()  # our own descendant, by PID
        except psutil.Error:
            pass
    return problems
