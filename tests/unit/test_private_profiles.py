"""Private profile directories: those a killed kernel left are removed once nothing of it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from nbdist.launch import private_profiles

# A separate process makes the directory and exits (as a killed kernel would, without
# removing it); it notes one process it started, which keeps running until the test ends it.
_OWNER = """
import subprocess, sys, tempfile
tempfile.tempdir = sys.argv[1]
from nbdist.launch import private_profiles
path = private_profiles.make()
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
if sys.argv[2] == "record":
    private_profiles.record_processes(path, {child.pid})
print(path, child.pid, flush=True)
"""


def _made_by_a_process_that_exited(folder, record: bool) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _OWNER, str(folder), "record" if record else "none"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return out[0], int(out[1])


def _end(pid: int) -> None:
    os.kill(pid, 9)
    for _ in range(100):  # the child is re-parented to init, which reaps it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def test_a_dead_owners_directory_stays_while_its_processes_run_and_goes_after(tmp_path):
    path, child = _made_by_a_process_that_exited(tmp_path, record=True)
    try:
        assert os.path.basename(path).startswith("nbdist-")
        assert private_profiles.remove_orphans(str(tmp_path)) == []
        assert os.path.isdir(path)
    finally:
        _end(child)
    assert private_profiles.remove_orphans(str(tmp_path)) == [path]
    assert not os.path.exists(path)


def test_unrecorded_processes_get_a_grace_after_the_last_write(tmp_path):
    path, child = _made_by_a_process_that_exited(tmp_path, record=False)
    _end(child)
    log = os.path.join(path, "log")
    os.makedirs(log)
    with open(os.path.join(log, "rank.exit"), "w") as f:
        f.write("0")
    assert private_profiles.remove_orphans(str(tmp_path)) == []  # a rank may still write here
    old = time.time() - private_profiles.UNRECORDED_GRACE_S - 1
    for folder, _, names in os.walk(path):
        for name in [*names, "."]:
            os.utime(os.path.join(folder, name), (old, old))
    assert private_profiles.remove_orphans(str(tmp_path)) == [path]


def test_a_live_owners_directory_and_directories_not_made_by_nbdist_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    mine = private_profiles.make()  # owned by this (live) process
    no_owner = tmp_path / "nbdist-abcdefgh"  # a named profile's, or another program's
    no_owner.mkdir()
    other_name = tmp_path / "nbdist-tests-abcdefgh"
    other_name.mkdir()
    (other_name / private_profiles.OWNER_FILE).write_text(
        '{"owner": {"pid": 1, "created": 0}, "processes": []}'
    )
    link = tmp_path / "nbdist-linklink"
    link.symlink_to(other_name)
    assert private_profiles.remove_orphans(str(tmp_path)) == []
    for kept in (mine, no_owner, other_name, link):
        assert os.path.lexists(kept), kept


@pytest.mark.parametrize(
    "text", ["", "{", "[]", '{"owner": "x"}', '{"owner": [1, 0], "processes": []}']
)
def test_an_unreadable_owner_file_keeps_the_directory(tmp_path, text):
    path = tmp_path / "nbdist-zzzzzzzz"
    path.mkdir()
    (path / private_profiles.OWNER_FILE).write_text(text)
    assert private_profiles.remove_orphans(str(tmp_path)) == []
    assert path.is_dir()


def test_a_stop_that_leaves_files_behind_marks_the_directory_for_the_next_start(
    tmp_path, monkeypatch
):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = private_profiles.make()
    real_rmtree = private_profiles.shutil.rmtree

    def rank_exit_written_meanwhile(target, ignore_errors=False):
        # What a zygote still reaping a rank does to a removal under way: a file appears
        # after the listing, and the directory holding it stays.
        real_rmtree(target, ignore_errors=ignore_errors)
        os.makedirs(os.path.join(target, "log"), exist_ok=True)
        with open(os.path.join(target, "log", "zygote.status.json.exit.4242"), "w") as f:
            f.write("0")

    monkeypatch.setattr(private_profiles.shutil, "rmtree", rank_exit_written_meanwhile)
    private_profiles.remove_profile(path)
    assert os.path.isdir(path)
    monkeypatch.setattr(private_profiles.shutil, "rmtree", real_rmtree)
    # This process still runs, but the directory is marked as nobody's: the next start clears it.
    assert private_profiles.remove_orphans(str(tmp_path)) == [path]


def test_a_clean_stop_removes_the_directory(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = private_profiles.make()
    os.makedirs(os.path.join(path, "security"))
    private_profiles.remove_profile(path)
    assert not os.path.exists(path)
