"""Synced files across a session's life (2 CPU ranks, gloo): a restart, a stop, a rank killed.

A restart's ranks are fresh processes: the synced paths are on their ``sys.path``
again, with the files as they are at the restart. A stop removes the machine's
copies; copies whose ranks were all killed (nobody left to remove them) go at the
next copying sync on that machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import psutil
import pytest

import nbdist
from nbdist.driver.file_sync import sync_files
from nbdist.engine import synced_files


def test_a_restart_syncs_again_and_a_stop_removes_the_copies(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "model.py").write_text("VALUE = 1\n")
    # The ranks inherit it: their copies land in the test's folder.
    monkeypatch.setenv(synced_files.SYNC_DIR_ENV, str(tmp_path / "sync"))
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        gone = tmp_path / "gone"
        gone.mkdir()
        (gone / "helper.py").write_text("")
        sync_files(s, [gone], copy=True)
        report = sync_files(s, [proj], copy=True)
        copy = report.used[0][str(proj)]
        assert copy.startswith(str(tmp_path / "sync")) and os.path.isfile(
            os.path.join(copy, "model.py")
        )
        (proj / "model.py").write_text("VALUE = 2\n")
        shutil.rmtree(gone)
        with pytest.warns(
            UserWarning,
            match=f"{gone}/? not synced again after the restart \\(%dist_sync: {gone}/? is gone",
        ):
            s.restart()
        assert s.restarted.fresh
        # Fresh ranks import the file as it was at the restart, from the copy.
        s.run("import model")
        assert s.pull("model.__file__") == [os.path.join(copy, "model.py")] * 2
        assert s.pull("model.VALUE") == [2, 2]
        # A path of the same name synced after the gone one was dropped keeps apart.
        (tmp_path / "other" / "proj").mkdir(parents=True)
        (tmp_path / "other" / "proj" / "tool.py").write_text("NAME = 'tool'\n")
        sync_files(s, [tmp_path / "other" / "proj"], copy=True)
        s.run("import sys; sys.modules.pop('model')\nimport model, tool")
        assert s.pull("(model.VALUE, tool.NAME)") == [(2, "tool")] * 2
    assert not os.path.exists(os.path.dirname(copy)), "the stop removed the session's copies"


def test_copies_whose_ranks_are_all_gone_are_pruned_and_no_other(tmp_path, monkeypatch):
    monkeypatch.setenv(synced_files.SYNC_DIR_ENV, str(tmp_path))
    # A session whose rank was killed: its owner file names a process that has ended.
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(ended.pid).create_time()
    ended.wait()
    dead = synced_files.copies_dir("dead-session")
    os.makedirs(os.path.join(dead, ".owners"))
    open(os.path.join(dead, ".owners", f"{ended.pid}-{created:.3f}"), "w").close()
    # A session whose rank lives (this process), and one being made (no owner yet).
    synced_files.write("live-session", "/x/src", {})
    made = synced_files.copies_dir("being-made")
    os.makedirs(made)
    # Another machine's session in a shared folder: judged by that machine, never here.
    elsewhere = os.path.join(os.path.dirname(dead), "other-session-0123abcd")
    os.makedirs(os.path.join(elsewhere, ".owners"))
    open(os.path.join(elsewhere, ".owners", f"{ended.pid}-{created:.3f}"), "w").close()
    assert synced_files.prune() == [os.path.basename(dead)]
    assert not os.path.exists(dead)
    assert os.path.isdir(synced_files.copies_dir("live-session")) and os.path.isdir(made)
    assert os.path.isdir(elsewhere)


def test_a_stop_after_every_rank_died_still_removes_the_copies(tmp_path, monkeypatch):
    # No rank answers the request to remove them: the kernel removes this machine's itself.
    # Before: they stayed past %dist_stop and the kernel's end, until a later copying sync.
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "model.py").write_text("VALUE = 1\n")
    monkeypatch.setenv(synced_files.SYNC_DIR_ENV, str(tmp_path / "sync"))
    s = nbdist.DistSession(2, cpu=True, timeout=120).start()
    try:
        copy = sync_files(s, [proj], copy=True).used[0][str(proj)]
        pids = [r.pid for r in s.ranks]
        for pid in pids:
            os.kill(pid, 9)
        psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)
    finally:
        s.stop()
    assert not os.path.exists(os.path.dirname(copy)), "the stop left the dead ranks' copies"
