"""Shared test set-up: isolated IPython/Jupyter dirs, a check that no process outlives the run,
and how the tests share out between pytest-xdist's workers.

The check is by PID: every process this test run started (children of the
pytest process, recursively) must be gone at the end; nbdist must never leave
an engine, nanny, zygote or controller behind. Under ``-n N`` each worker is a
test run of its own here (its own isolated dirs, its own processes checked).
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

_ISOLATED = tempfile.mkdtemp(prefix="nbdist-tests-")
# Removed when pytest exits: every process of the run is gone by then (checked below).
atexit.register(shutil.rmtree, _ISOLATED, ignore_errors=True)
for _var in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR", "JUPYTER_DATA_DIR", "JUPYTER_CONFIG_DIR"):
    os.environ[_var] = os.path.join(_ISOLATED, _var.lower())
    os.makedirs(os.environ[_var], exist_ok=True)
# Keep each rank at one thread so several test sessions on a small machine do not thrash.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests play the kernel's Ctrl-C with _thread.interrupt_main(), which acts through the
# SIGINT handler. A run started in the background by a non-interactive shell (as CI
# may be) inherits SIGINT ignored, and the interrupt would do nothing: restore Python's
# default, as a kernel has.
signal.signal(signal.SIGINT, signal.default_int_handler)


# How pytest-xdist's workers (``-n 2 --dist loadscope``, as scripts/test.sh runs the whole suite)
# share the tests: a module's tests stay together on one worker, in file order (a module-scoped
# session starts once; tests that follow one another still do), with two exceptions:
# - each example notebook goes to whichever worker is free: each starts its own kernel and
#   ranks, and together they are the longest module;
# - tests/cluster runs on one worker, one test after another: its tests share one Slurm cluster
#   and sshd, and some look for the processes they started among all of the machine's.
_SPREAD_MODULES = ("tests/notebooks/test_examples.py",)
_ONE_WORKER_FOLDERS = ("tests/cluster/",)
# The folders in the order the workers take them up: those whose tests start kernels and ranks
# first, the unit tests (hundreds, each a fraction of a second) last, so that both workers end
# within moments of each other. xdist's own order (most tests first) left the notebooks and
# the soak, each a scope of one long test, to the end: one worker ran them alone for 89 s of a
# 20.6-minute run (2026-12-06). A folder not named here comes before tests/unit.
_FOLDER_ORDER = (
    "tests/cluster/",
    "tests/notebooks/",
    "tests/reliability/",
    "tests/faults/",
    "tests/debugging/",
    "tests/multihost/",
    "tests/dist/",
)
_LAST_FOLDER = "tests/unit/"
# Tests marked ``alone``, which scripts/test.sh runs after the others, in one process with
# nothing beside them: the browser tests time how fast the page answers (a machine shared with
# another test's ranks stretched one answer past 20 s), and 256 ranks starting at once fill
# the machine (they would starve whatever ran beside them), as bench/log_cost.py's profiled
# windows do (example 25's rank 0, beside it, took 32 % of its steps in compute where it
# takes 4 %, and was flagged a straggler) and bench/train.py's four jobs' ranks would.
_ALONE = (
    "tests/ui/",
    "tests/reliability/test_start_limits.py",
    "tests/dist/test_bench_log_cost.py",
    "tests/dist/test_bench_train.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark the tests that must run with nothing beside them ``alone``; put the folders in
    the order the workers take them up (see above; a stable sort: file order within each)."""
    for item in items:
        if item.nodeid.startswith(_ALONE):
            item.add_marker(pytest.mark.alone)
    items.sort(key=lambda item: _folder_rank(item.nodeid))


def _folder_rank(nodeid: str) -> int:
    for i, folder in enumerate(_FOLDER_ORDER):
        if nodeid.startswith(folder):
            return i
    return len(_FOLDER_ORDER) + nodeid.startswith(_LAST_FOLDER)


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    if module in _SPREAD_MODULES:
        return nodeid
    for folder in _ONE_WORKER_FOLDERS:
        if module.startswith(folder):
            return folder
    return module


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist installed, never called
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the scopes above (xdist's own would group by module only)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    # The scopes in collection order (the folders' order above), not xdist's most-tests-first.
    config.option.loadscopereorder = False
    return TestScopes(config, log)


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def wait_gone(pids, timeout: float = 15.0) -> list[int]:
    """PIDs among ``pids`` still alive after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    before = {p.pid for p in _descendants()}
    yield
    leftovers = [p for p in _descendants() if p.pid not in before]
    alive = wait_gone([p.pid for p in leftovers], timeout=15)
    if alive:
        names = []
        for pid in alive:
            try:
                names.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
            except psutil.Error:
                pass
        pytest.fail("processes started by the tests outlived them:\n" + "\n".join(names))


def run_torchrun(script, nproc: int, env: dict, cwd, timeout: float = 240) -> tuple[int, str]:
    """Run ``script`` under ``torchrun --standalone`` (torchrun's own one-node rendezvous) with
    ``nproc`` workers; its return code and its output (stderr in it). Past ``timeout`` seconds,
    torchrun and its workers (the process group started here) are killed."""
    # torchrun's own logs under cwd: by default each run leaves a torchelastic_* in the temp dir.
    log_dir = os.path.join(cwd, "torchrun-logs")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--log-dir", log_dir]
    proc = subprocess.Popen(
        [*command, "--nproc_per_node", str(nproc), str(script)],
        env=env,
        cwd=cwd,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


def terminate_in_order(procs) -> None:
    """SIGTERM ``procs`` by PID, last started first (engines before their controller),
    then wait; SIGKILL any that did not exit within 15 s."""
    for proc in reversed(procs):
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_controller(client_file, timeout: float = 60.0) -> None:
    """Wait until an ipcontroller has written its client and engine connection files whole.

    The controller creates each file and then writes it, the engine file after the client
    file: a file that exists may still be empty (a client reading it then fails to parse
    it, as happened once in CI).
    """
    client_file = pathlib.Path(client_file)
    engine_file = client_file.with_name(client_file.name.replace("-client.json", "-engine.json"))
    deadline = time.monotonic() + timeout
    while True:
        try:
            json.loads(client_file.read_text())
            json.loads(engine_file.read_text())
            return
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the controller wrote no whole connection files in {timeout:g} s: "
                    f"{client_file}, {engine_file}"
                ) from None
            time.sleep(0.1)


@pytest.fixture
def external_cluster(tmp_path, request):
    """An ipcontroller and two ipengines started by hand, as on other hosts.

    The controller checks the engines' heartbeats every 100 ms (a dead engine is noticed
    at once), or every ``request.param`` ms where a test parametrizes the fixture.
    """
    period = getattr(request, "param", 100)
    profile = tmp_path / "profile"
    profile.mkdir()
    common = [f"--profile-dir={profile}", "--cluster-id=ext"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ipyparallel.controller",
                "--ip=127.0.0.1",
                f"--HeartMonitor.period={period}",
                *common,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    client_file = profile / "security" / "ipcontroller-ext-client.json"
    wait_for_controller(client_file)
    for _ in range(2):
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ipyparallel.engine", *common],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        import ipyparallel as ipp

        probe = ipp.Client(str(client_file))  # both engines registered before anyone attaches
        deadline = time.monotonic() + 60
        while len(probe.ids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        probe.close()
        yield client_file, procs
    finally:
        pids = []
        for proc in procs:
            try:
                pids += [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                pass
        terminate_in_order(procs)
        for pid in wait_gone(pids, timeout=15):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def dist_kernel():
    """One real Jupyter kernel with ``%dist_start 2 --cpu`` done, shared by a module's tests."""
    from tests.notebooks.conftest import Kernel

    kernel = Kernel()
    try:
        kernel.start_dist(2)
        yield kernel
    finally:
        kernel.shutdown()
