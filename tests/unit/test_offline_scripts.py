"""scripts/wheelhouse.sh and scripts/gpu_check.sh: help, and clear errors on bad input.

Runs on any machine (no GPU, no network): each case fails before either script
downloads or installs anything. One opt-in test (NBDIST_TEST_WHEELHOUSE=1; it needs
internet and node, ~2-3 minutes) builds a real wheelhouse into a temporary directory
and checks what a GPU server without internet would get.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "scripts" / "wheelhouse.sh"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
LIMIT = 60_000_000  # the 60 MB, decimal


def _run(script: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script), *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", [WHEELHOUSE, GPU_CHECK], ids=lambda p: p.name)
def test_script_parses_and_says_what_it_does(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith("# Runs on"), "header comment: what it does and where it runs"


@pytest.mark.parametrize("script", [WHEELHOUSE, GPU_CHECK], ids=lambda p: p.name)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help(script, flag):
    res = _run(script, flag)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: bash scripts/{script.name} ")
    assert res.stderr == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "missing DIR"),
        (("DIR", "--python", "2.7"), "--python '2.7': nbdist needs Python 3.10 or newer"),
        (("DIR", "--python", "3.9"), "needs Python 3.10 or newer"),
        (("DIR", "--python", "three"), "needs Python 3.10 or newer"),
        (("DIR", "--python"), "--python needs a version"),
        (("DIR", "--max-mb", "lots"), "--max-mb 'lots': a whole number of MB"),
        (("DIR", "--max-mb"), "--max-mb needs a number"),
        (("DIR", "--leave-out"), "--leave-out needs package names, comma-separated"),
        (("DIR", "--leave-out", "numpy pandas"), "--leave-out 'numpy pandas': package names sep"),
        (("DIR", "--leave-out", "numpy,"), "--leave-out 'numpy,': package names separated by"),
        (("DIR", "--frobnicate"), "unknown option '--frobnicate'"),
        (("A", "B"), "one DIR only"),
    ],
)
def test_wheelhouse_bad_arguments(tmp_path, args, message):
    args = tuple(str(tmp_path / "wh") if a == "DIR" else a for a in args)
    res = _run(WHEELHOUSE, *args)
    assert res.returncode == 2
    assert "wheelhouse.sh: error: " in res.stderr and message in res.stderr, res.stderr
    assert not (tmp_path / "wh").exists(), "nothing is created on bad arguments"


def test_wheelhouse_dir_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    res = _run(WHEELHOUSE, str(f))
    assert res.returncode == 2
    assert "exists and is not a directory" in res.stderr


def _wheel_of_this_checkout(path: Path, change: dict[str, bytes] | None = None) -> None:
    """A zip holding nbdist/ as this checkout has it (and a built extension's file), as the
    wheel scripts/wheelhouse.sh makes would; ``change``: names replaced or added."""
    files = {
        "nbdist/" + p.relative_to(ROOT / "nbdist").as_posix(): p.read_bytes()
        for p in (ROOT / "nbdist").rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.relative_to(ROOT / "nbdist").parts[0] != "labextension"
    }
    files["nbdist/labextension/package.json"] = b"{}"
    files.update(change or {})
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


@pytest.fixture
def fake_wheelhouse(tmp_path):
    wh = tmp_path / "wh"
    wh.mkdir()
    _wheel_of_this_checkout(wh / "nbdist-0.1.0-py3-none-any.whl")
    return wh


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "missing WHEELHOUSE"),
        (("MISSING",), "is not a directory (make one with scripts/wheelhouse.sh)"),
        (("EMPTY",), "no nbdist-*.whl in"),
        (("WH", "--steps", "tests,bogus"), "--steps: unknown step 'bogus'"),
        (("WH", "--timeout", "soon"), "--timeout 'soon': seconds"),
        (("WH", "--venv"), "--venv needs a directory"),
        (("WH", "--examples"), "--examples needs a pattern"),
        (("WH", "--frobnicate"), "unknown option '--frobnicate'"),
        (("WH", "OUT", "EXTRA"), "unexpected argument 'EXTRA'"),
    ],
)
def test_gpu_check_bad_arguments(tmp_path, fake_wheelhouse, args, message):
    (tmp_path / "empty").mkdir()
    paths = {
        "MISSING": tmp_path / "missing",
        "EMPTY": tmp_path / "empty",
        "WH": fake_wheelhouse,
        "OUT": tmp_path / "out",
    }
    res = _run(GPU_CHECK, *(str(paths.get(a, a)) for a in args))
    assert res.returncode == 2
    assert "gpu_check.sh: error: " in res.stderr and message in res.stderr, res.stderr
    assert not (tmp_path / "out").exists(), "no output directory on bad arguments"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"nbdist/errors.py": b"# an older errors.py\n"}, "nbdist/errors.py"),
        ({"nbdist/dashboard/widget.js": b"// an older widget\n"}, "nbdist/dashboard/widget.js"),
        ({"nbdist/gone_since.py": b""}, "nbdist/gone_since.py"),
    ],
    ids=["changed module", "changed asset", "module removed since"],
)
@pytest.mark.parametrize("dry", [(), ("--dry-run",)], ids=["run", "dry run"])
def test_gpu_check_refuses_a_wheel_built_from_other_sources(tmp_path, change, named, dry):
    """A wheelhouse made before the last commits would check old code under new tests; a dry
    run given the wheelhouse says so here, before a GPU machine's time is spent."""
    wh = tmp_path / "wh"
    wh.mkdir()
    _wheel_of_this_checkout(wh / "nbdist-0.1.0-py3-none-any.whl", change)
    env = dict(os.environ, PYTHON=sys.executable, NBDIST_GPU_CHECK_OUT=str(tmp_path / "o"))
    res = subprocess.run(
        ["bash", str(GPU_CHECK), str(wh), *dry],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2
    assert "was built from other sources than this checkout's nbdist/ (1 file(s) differ" in (
        res.stderr
    ), res.stderr
    assert named in res.stderr and "make the wheelhouse again" in res.stderr
    assert not (tmp_path / "o").exists()


def test_gpu_check_dry_run_takes_a_wheelhouse_built_from_this_checkout(tmp_path, fake_wheelhouse):
    env = dict(os.environ, PYTHON=sys.executable)
    res = subprocess.run(
        ["bash", str(GPU_CHECK), str(fake_wheelhouse), "--dry-run", "--examples", "00_*"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "the jobs a run would start" in res.stdout and "00_quickstart" in res.stdout


def test_gpu_check_wheelhouse_for_another_python(tmp_path, fake_wheelhouse):
    (fake_wheelhouse / "wheelhouse.txt").write_text(
        "# nbdist wheelhouse: CPython 3.99, manylinux x86_64; torch not included\n"
    )
    env = dict(os.environ, PYTHON=sys.executable, NBDIST_GPU_CHECK_OUT=str(tmp_path / "o"))
    res = subprocess.run(
        ["bash", str(GPU_CHECK), str(fake_wheelhouse)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2
    assert "the wheelhouse is for CPython 3.99 but" in res.stderr
    assert f"--python {sys.version_info[0]}.{sys.version_info[1]}" in res.stderr
    assert not (tmp_path / "o").exists()


def test_gpu_check_without_torch(tmp_path, fake_wheelhouse):
    """A Python without torch is refused before any venv or install."""
    env = dict(os.environ, PYTHON="/usr/bin/python3", NBDIST_GPU_CHECK_OUT=str(tmp_path / "o"))
    if not Path("/usr/bin/python3").exists():
        pytest.skip("no /usr/bin/python3 here")
    probe = subprocess.run(["/usr/bin/python3", "-c", "import torch"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("/usr/bin/python3 has torch here")
    res = subprocess.run(
        ["bash", str(GPU_CHECK), str(fake_wheelhouse)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2
    assert "cannot import torch: install the CUDA build of torch" in res.stdout + res.stderr


# Tags a CPython 3.12 on manylinux_2_28 x86_64 (what torch's CUDA wheels need) accepts.
_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
_CP312 = set(cpython_tags((3, 12), ["cp312"], _PLATFORMS)) | set(
    compatible_tags((3, 12), "cp312", _PLATFORMS)
)
_TORCH_SIDE = re.compile(r"^(torch|triton|pytorch-triton.*|nvidia-(?!ml-py$).*|cuda-.*)$")


@pytest.mark.skipif(
    os.environ.get("NBDIST_TEST_WHEELHOUSE") != "1",
    reason="builds a real wheelhouse (internet, node, ~3 min): set NBDIST_TEST_WHEELHOUSE=1",
)
@pytest.mark.timeout(1200)
def test_wheelhouse_for_python312(tmp_path):
    out = tmp_path / "wheelhouse"
    res = _run(WHEELHOUSE, str(out), "--python", "3.12", timeout=1100)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    wheels = sorted(out.glob("*.whl"))
    size = sum(p.stat().st_size for p in out.iterdir())
    assert size < LIMIT, f"{size / 1e6:.1f} MB"
    assert f"wheelhouse: {len(wheels)} wheels," in res.stdout

    names = set()
    for whl in wheels:
        name, _version, _build, tags = parse_wheel_filename(whl.name)
        names.add(name)
        assert tags & _CP312, f"{whl.name} does not install on CPython 3.12 manylinux x86_64"
        assert not _TORCH_SIDE.match(name), f"{whl.name}: the server's torch provides it"
    expected = {"nbdist", "ipyparallel", "ipykernel", "numpy", "pandas", "plotly", "nvidia-ml-py"}
    expected |= {"pytest", "pytest-timeout", "nbclient", "nbformat"}
    assert expected <= names, expected - names

    (nbdist_whl,) = out.glob("nbdist-*.whl")
    members = zipfile.ZipFile(nbdist_whl).namelist()
    assert any(
        m.endswith(".data/data/share/jupyter/labextensions/nbdist/package.json") for m in members
    ), members

    # Again into the same directory: the same set, nothing stale left behind.
    again = _run(WHEELHOUSE, str(out), "--python", "3.12", timeout=1100)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in out.glob("*.whl")) == [p.name for p in wheels]


@pytest.mark.skipif(
    os.environ.get("NBDIST_TEST_WHEELHOUSE") != "1",
    reason="builds a real wheelhouse (internet, node, ~3 min): set NBDIST_TEST_WHEELHOUSE=1",
)
@pytest.mark.timeout(1200)
def test_wheelhouse_for_a_gpu_image_with_deepspeed(tmp_path):
    """The GPU check's set: DeepSpeed built here (it publishes source only) with what it
    needs but torch's own dependencies, torchao, HTA without jupyterlab, and without the
    image's numpy and pandas."""
    out = tmp_path / "wheelhouse"
    args = ("--with-torchao", "--with-deepspeed", "--with-hta", "--leave-out", "numpy,pandas")
    res = _run(WHEELHOUSE, str(out), *args, timeout=1100)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    names = {parse_wheel_filename(w.name)[0] for w in out.glob("*.whl")}
    assert {"deepspeed", "hjson", "pydantic", "ninja", "torchao", "nbdist"} <= names, names
    assert {"holistictraceanalysis", "pydot"} <= names, names
    # numpy and pandas are left out as asked; sympy and networkx would come only through
    # DeepSpeed's requirement of torch (and networkx through HTA's), which the server's
    # torch already has; jupyterlab only serves HTA's own notebooks.
    assert not names & {"numpy", "pandas", "sympy", "networkx", "mpmath", "jupyterlab"}, names
    manifest = (out / "wheelhouse.txt").read_text()
    assert re.search(
        r"^# left out, the server must have them: numpy==\S+ pandas==\S+", manifest, re.M
    )
    assert sum(p.stat().st_size for p in out.iterdir()) < LIMIT

    # A name that is not in the set is a typo, refused before anything is downloaded.
    bad = _run(WHEELHOUSE, str(tmp_path / "other"), "--leave-out", "numpyy", timeout=600)
    assert bad.returncode != 0
    assert "--leave-out numpyy: not in the resolved set" in bad.stderr, bad.stderr[-2000:]
    assert not list((tmp_path / "other").glob("*.whl"))
