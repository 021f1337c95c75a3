"""A launcher-started rank's crash record, in real processes: kept through a crash, gone otherwise.

nbdist.engine.crash_record, run in a fresh Python per test with NBDIST_CRASH_DIR
pointing into the test's folder (the ranks' own tests: tests/cluster).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

OPEN = """
import os, sys
from nbdist.engine import crash_record
path = crash_record.open_record()
print(path, flush=True)
"""


def _env(tmp_path) -> dict:
    # faulthandler on from the start (PYTHONFAULTHANDLER) would keep the record from opening.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    return {**env, "NBDIST_CRASH_DIR": str(tmp_path)}


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    env = _env(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OPEN + code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _records(tmp_path) -> list[str]:
    folder = tmp_path / f"nbdist-crash-{os.getuid()}"
    return sorted(os.listdir(folder)) if folder.is_dir() else []


def test_a_segfault_leaves_the_record_with_the_stack_and_an_orderly_exit_leaves_none(tmp_path):
    crashed = _run(tmp_path, "import ctypes\nctypes.string_at(0)\n")
    assert crashed.returncode == -11, crashed.stderr
    path = crashed.stdout.split()[0]
    assert os.path.basename(path) in _records(tmp_path)
    with open(path) as f:
        record = f.read()
    assert record.startswith("Fatal Python error: Segmentation fault"), record
    assert 'File "<string>", line 7 in <module>' in record, record
    os.remove(path)
    ended = _run(tmp_path, "print('done')\n")
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout.split()[0].endswith(".txt"), ended.stdout  # it had one
    assert _records(tmp_path) == []


def test_a_child_that_ends_takes_neither_the_parents_record_nor_its_handler(tmp_path):
    result = _run(
        tmp_path,
        "import faulthandler\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    crash_record.remove_own_record()\n"  # what an end of a rank would do
        "    print('child handler', faulthandler.is_enabled(), flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('kept', os.path.exists(path), flush=True)\n"
        "os._exit(0)\n",  # no atexit: the record stays for the test to see
    )
    assert "child handler False" in result.stdout, result.stdout + result.stderr
    assert "kept True" in result.stdout, result.stdout + result.stderr


def test_a_record_is_pruned_once_its_process_is_gone_never_while_it_runs(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", OPEN + "sys.stdin.read()\n"],
        env=_env(tmp_path),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        live = os.path.basename(holder.stdout.readline().strip())
        crashed = _run(tmp_path, "import ctypes\nctypes.string_at(0)\n")
        dead = os.path.basename(crashed.stdout.split()[0])
        assert _records(tmp_path) == sorted([live, dead])
        # The next record opened on this machine prunes the dead process's, not the live one's.
        _run(tmp_path, "os._exit(0)\n")
        assert live in _records(tmp_path) and dead not in _records(tmp_path)
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    assert live not in _records(tmp_path)  # its orderly exit removed it


def test_a_records_folder_others_can_write_to_gets_no_record(tmp_path):
    folder = tmp_path / f"nbdist-crash-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    result = _run(tmp_path, "print('path', repr(path))\n")
    assert "path ''" in result.stdout, result.stdout + result.stderr
    assert _records(tmp_path) == []
