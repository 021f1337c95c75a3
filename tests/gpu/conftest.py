"""The GPU tests' shared set-up: skipped as a whole without CUDA, sessions that leave nothing behind.

Every test here needs a CUDA device, and is meaningful with ONE: two ranks then
share it (NCCL >= 2.30, or gloo with CUDA tensors), and with more GPUs each rank
gets its own. The test process itself never initialises CUDA (references are
computed on the CPU in float64, or on a rank): it only counts the GPUs, which
``torch.cuda.is_available()`` does without creating a context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import nbdist
from tests.conftest import wait_gone

# Two ranks can share one GPU over NCCL from this version on (older NCCL refuses:
# "Duplicate GPU detected"); nbdist then uses gloo with CUDA tensors instead.
NCCL_SHARES_GPUS = (2, 30, 0)


def _no_cuda_reason() -> str:
    """Why the GPU tests cannot run here ('' when they can)."""
    if torch.cuda.is_available():
        return ""
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return f"tests/gpu need a CUDA GPU: torch {torch.__version__} ({build}) sees none"


def pytest_report_header(config):
    """One line under pytest's header: the GPUs and NCCL these tests run on, or why they skip."""
    reason = _no_cuda_reason()
    if reason:
        return [f"{reason}; every test in tests/gpu is skipped"]
    return [f"tests/gpu: {torch.cuda.device_count()} GPU(s) visible, NCCL {nccl_version()}"]


def pytest_configure(config):
    """The ``example`` marker: the README strategies-table rows (notebook numbers) a test covers."""
    config.addinivalue_line(
        "markers",
        "example(*numbers): the examples/NN_*.ipynb rows of README's strategies table this "
        "GPU test covers (tests/unit/test_gpu_coverage.py checks every row has one)",
    )


@pytest.fixture(scope="session", autouse=True)
def _needs_cuda():
    """Skip every test of this directory without CUDA (session scope: before any session starts)."""
    reason = _no_cuda_reason()
    if reason:
        pytest.skip(reason)


def nccl_version() -> tuple[int, ...]:
    """The NCCL torch was built with, e.g. (2, 30, 7); (0,) without NCCL.

    ``ncclGetVersion`` needs no GPU and creates no CUDA context.
    """
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return (0,)
    if isinstance(version, int):  # very old torch: 2304 for 2.3.4, 21903 for 2.19.3
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(version)


def nccl_shares_gpus() -> bool:
    """True if this torch's NCCL lets two ranks use one GPU."""
    return nccl_version() >= NCCL_SHARES_GPUS


def two_nccl_ranks_reason() -> str:
    """Why two NCCL ranks cannot run here ('' when they can: 2 GPUs, or NCCL >= 2.30 on one)."""
    if torch.cuda.device_count() >= 2 or nccl_shares_gpus():
        return ""
    found = ".".join(map(str, nccl_version()))
    return (
        f"two NCCL ranks need 2 GPUs, or NCCL >= 2.30 to share one; "
        f"{torch.cuda.device_count()} GPU and NCCL {found} here"
    )


def visible_gpu_indices() -> list[int]:
    """The GPU indices this process may use, as CUDA_VISIBLE_DEVICES would name them."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return list(range(torch.cuda.device_count()))
    entries = [e.strip() for e in mask.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        pytest.skip(f"CUDA_VISIBLE_DEVICES={mask!r} names GPUs by UUID: these tests need indices")
    return [int(e) for e in entries][: torch.cuda.device_count()]


@pytest.fixture(scope="session")
def gpu_uuids() -> dict[int, str]:
    """{GPU index: its UUID as torch reports it}, asked in a subprocess (CUDA stays off here).

    The reference for device binding: a rank that sees exactly one GPU must report
    the same UUID for its ``cuda:0`` as a plain process sees for that index. Asked
    through torch rather than nvidia-smi, whose numbering ignores CUDA_DEVICE_ORDER.
    """
    code = (
        "import json, torch\n"
        "print(json.dumps([str(torch.cuda.get_device_properties(i).uuid)"
        " for i in range(torch.cuda.device_count())]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    uuids = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(zip(visible_gpu_indices(), uuids))


def _processes_of(session) -> set[int]:
    pids = {r.pid for r in session.ranks}
    if session.cluster is not None:
        pids |= set(session.cluster.pids)
    return pids


def stop_cleanly(session, pids=()) -> None:
    """Stop ``session`` and fail if any process it started (or ``pids``) outlives it."""
    pids = set(pids) | (_processes_of(session) if session.running else set())
    session.stop()
    left = wait_gone(sorted(pids), timeout=30)
    if left:
        pytest.fail(f"processes of the session outlived stop(): {left}")


@pytest.fixture
def start_session():
    """``start_session(n, **options)``: a started DistSession, stopped cleanly after the test.

    Defaults fit a GPU host: 300 s to start (CUDA and NCCL initialise on every rank)
    and no run history on disk.
    """
    started = []

    def start(n=None, **options):
        options.setdefault("timeout", 300)
        options.setdefault("history", False)
        session = nbdist.DistSession(n, **options)
        session.start()
        started.append((session, _processes_of(session)))  # also checked if the test stops it
        return session

    yield start
    for session, pids in reversed(started):
        stop_cleanly(session, pids)


@pytest.fixture(scope="module")
def pair():
    """Two ranks for a module's tests: one per GPU with 2 GPUs or more, else both on GPU 0.

    Sharing one GPU, the backend is NCCL with NCCL >= 2.30, otherwise gloo with CUDA
    tensors: what ``%dist_start 2`` gives a user of that machine.
    """
    session = nbdist.DistSession(2, timeout=300, history=False)
    try:
        session.start()
        yield session
    finally:
        stop_cleanly(session)


# The two ways ONE GPU is used by ranks, each a parametrisation of ``one_gpu`` (its id is
# the key, which scripts/gpu_check_steps.py selects with -k to run them side by side):
# two ranks sharing GPU 0 over gloo with CUDA tensors (what ``%dist_start 2`` gives with
# NCCL < 2.30: point-to-point staged through host memory, where the first GPU run's bugs
# were), and one rank on GPU 0 over NCCL (NCCL's own collectives and DTensor paths).
ONE_GPU_LAYOUTS = {
    "gloo2": dict(n=2, gpus=[0], backend="gloo"),
    "nccl1": dict(n=1, gpus=[0], backend="nccl"),
}


def ranks_on_one_gpu(layout: str | dict, common: str = ""):
    """Start the ranks of ``layout`` (a key of ONE_GPU_LAYOUTS, or DistSession's options) on
    GPU 0, run ``common`` on them, yield the session, stop it cleanly afterwards."""
    options = ONE_GPU_LAYOUTS[layout] if isinstance(layout, str) else layout
    session = nbdist.DistSession(**options, timeout=300, history=False)
    try:
        session.start()
        if common:
            from nbdist.driver.sinks import ListSink

            session.run(common, sink=ListSink())
        yield session
    finally:
        stop_cleanly(session)


@pytest.fixture(scope="module", params=list(ONE_GPU_LAYOUTS))
def one_gpu(request):
    """Ranks on GPU 0 in each layout of ONE_GPU_LAYOUTS, for a module's tests.

    A module that needs definitions on the ranks sets ``COMMON`` (source run once
    on them after the start).
    """
    yield from ranks_on_one_gpu(request.param, getattr(request.module, "COMMON", ""))


@pytest.fixture(autouse=True)
def _one_gpu_alive(request):
    """Before a test on ``one_gpu``: ranks an earlier test killed (a segfault) are started again.

    The ranks are shared by a module's tests; without this, one crash fails every test
    after it with "rank 0 died", and the GPU check's results name one cause many times.
    """
    if "one_gpu" in request.fixturenames:
        from nbdist.driver.sinks import ListSink

        session = request.getfixturevalue("one_gpu")
        try:
            # A no-op cell: a rank whose death was not noticed yet fails it too.
            session.run("pass", sink=ListSink())
        except Exception:
            session.restart()
            common = getattr(request.module, "COMMON", "")
            if common:
                session.run(common, sink=ListSink())
    yield


def dist_stop_cleanly(shell) -> None:
    """``%dist_stop`` in ``shell``; fail if any process of its session outlives it."""
    session = shell.magics_manager.registry["DistMagics"].session
    if session is None or not session.running:
        return
    pids = _processes_of(session)
    shell.run_line_magic("dist_stop", "")
    left = wait_gone(sorted(pids), timeout=30)
    if left:
        pytest.fail(f"processes of the session outlived %dist_stop: {left}")


@pytest.fixture
def ipython():
    """A real IPython shell with nbdist loaded; ``%dist_stop`` after the test, nothing left behind."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext nbdist")
    magics = shell.magics_manager.registry["DistMagics"]
    if magics.session is not None and magics.session.running:  # the shell is a singleton
        stop_cleanly(magics.session)
    try:
        yield shell
    finally:
        dist_stop_cleanly(shell)
