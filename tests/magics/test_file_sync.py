"""``%dist_sync`` on real ranks (2 CPU ranks, gloo): the notebook's files importable on every rank.

Both ranks run on this machine, which sees the synced path itself: without
``--copy`` they use it in place; with ``--copy`` they get the copy a machine
without the files would get (in ``$NBDIST_SYNC_DIR``, set on the ranks here to a
folder of the test), so the copy, the changed-files-only updates, the removals,
the stale-module note and ``--reload`` are the ones a remote machine sees.
"""

from __future__ import annotations

import os
import stat

import pytest
from IPython.core.error import UsageError

from nbdist.driver.file_sync import sync_files
from nbdist.driver.sinks import ListSink
from nbdist.errors import NbdistError


def _session(sh):
    return sh.magics_manager.registry["DistMagics"].session


def _project(root):
    proj = root / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "model.py").write_text("VALUE = 1\n")
    (proj / "pkg" / "__init__.py").write_text("NAME = 'pkg'\n")
    (proj / "train.py").write_text("import sys\nprint('train', __file__, sys.argv[1:])\n")
    (proj / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (proj / "run.sh").chmod(0o755)
    # Left out by default: caches, version control, checkpoints of notebooks.
    (proj / "__pycache__").mkdir()
    (proj / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0" * 10)
    (proj / ".git").mkdir()
    (proj / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (proj / "data").mkdir()
    (proj / "data" / "big.bin").write_bytes(b"\1" * 1000)
    return proj


@pytest.fixture
def project(started, tmp_path, monkeypatch):
    """A project in the test's folder (the working directory), and where the ranks' copies go."""
    monkeypatch.chdir(tmp_path)
    sync_dir = tmp_path / "sync"
    _on_ranks(
        started, f"__import__('os').environ.__setitem__('NBDIST_SYNC_DIR', {str(sync_dir)!r})"
    )
    return _project(tmp_path), sync_dir


def _folder(path, files: dict):
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _on_ranks(sh, code):
    # The value of ``code``'s last line on each rank, as a list by rank.
    s = _session(sh)
    s.run(f"_synced_value = {code}", sink=ListSink())
    return s.pull("_synced_value")


def _sync(sh, capsys, line):
    result = sh.run_cell(f"%dist_sync {line}")
    assert result.success, result.error_in_exec
    return capsys.readouterr().out


def test_before_dist_start_it_says_to_start(shell):
    with pytest.raises(
        UsageError, match="no nbdist cluster is running: start one with %dist_start"
    ):
        shell.run_line_magic("dist_sync", "src")


def test_in_place_where_the_machine_sees_the_path(started, project, capsys):
    proj, sync_dir = project
    out = _sync(started, capsys, "proj")
    # 5 files: model.py, pkg/__init__.py, train.py, run.sh, data/big.bin (.git and __pycache__ left out).
    assert "nbdist: synced proj/ (5 files, 1.1 KiB) to 1 machine: 1 sees them in place" in out
    files = _on_ranks(started, "__import__('model').__file__")
    assert files == [str(proj / "model.py")] * 2
    assert not sync_dir.exists(), "nothing is copied where the path is seen in place"
    # Forgotten, so the next test imports model from its own copy.
    _session(started).run(
        f"import sys; del sys.modules['model']; sys.path.remove({str(proj)!r})", sink=ListSink()
    )


def test_a_copy_then_only_what_changed(started, project, capsys):
    proj, sync_dir = project
    out = _sync(started, capsys, "proj --copy --exclude 'data/*'")
    assert (
        "nbdist: synced proj/ (4 files, 91 B) to 1 machine: 1 holds a copy (4 files sent, 91 B)"
        in out
    )
    copy = _on_ranks(started, "__import__('os').path.dirname(__import__('model').__file__)")
    assert copy[0] == copy[1] and copy[0].startswith(str(sync_dir) + os.sep), copy
    copied = sorted(
        os.path.relpath(os.path.join(d, n), copy[0]) for d, _, ns in os.walk(copy[0]) for n in ns
    )
    assert copied == [".nbdist-manifest.json", "model.py", "pkg/__init__.py", "run.sh", "train.py"]
    assert (proj / "train.py").read_bytes() == open(os.path.join(copy[0], "train.py"), "rb").read()
    assert os.stat(os.path.join(copy[0], "run.sh")).st_mode & stat.S_IXUSR, "executable stays so"
    assert (
        _on_ranks(started, "(__import__('model').VALUE, __import__('pkg').NAME)")
        == [(1, "pkg")] * 2
    )

    # One file changed, one deleted: only the change travels, the deleted file goes.
    (proj / "model.py").write_text("VALUE = 22\n")
    (proj / "run.sh").unlink()
    out = _sync(started, capsys, "proj --exclude 'data/*'")
    assert "(3 files, 74 B) to 1 machine: 1 holds a copy (1 file sent, 11 B, 1 removed)" in out
    assert not os.path.exists(os.path.join(copy[0], "run.sh"))
    assert open(os.path.join(copy[0], "model.py")).read() == "VALUE = 22\n"
    # The ranks imported model before: it is named, and stays as imported until reloaded.
    assert "the ranks imported model before its file changed: %dist_sync --reload reloads it" in out
    assert _on_ranks(started, "__import__('model').VALUE") == [1, 1]
    out = _sync(started, capsys, "proj --exclude 'data/*' --reload")
    assert "1 holds a copy (up to date)" in out and "nbdist: reloaded on the ranks: model" in out
    assert _on_ranks(started, "__import__('model').VALUE") == [22, 22]
    # A file touched, not changed, is not sent again.
    os.utime(proj / "model.py", ns=(1, 1))
    assert "(up to date)" in _sync(started, capsys, "proj --exclude 'data/*'")

    # %dist_run of a script under the synced path runs the copy.
    result = started.run_cell(f"%dist_run {proj / 'train.py'} --x 1")
    assert result.success, result.error_in_exec
    out = capsys.readouterr().out
    assert f"train {os.path.join(copy[0], 'train.py')} ['--x', '1']" in out


def test_bad_paths_and_too_much_change_nothing(started, project, capsys):
    proj, sync_dir = project
    # One bad path among good ones: nothing synced, the good one not remembered either.
    with pytest.raises(UsageError, match=r"no file or directory 'nope' \(looked for .*nope\)"):
        started.run_line_magic("dist_sync", "proj/pkg nope")
    with pytest.raises(UsageError, match="needs a directory or file, e.g. %dist_sync src"):
        started.run_line_magic("dist_sync", "")
    with pytest.raises(
        NbdistError,
        match=r"more than 100 B to send, the limit \(.* in the first \d+ files; largest: .*\): "
        r"leave data out with --exclude 'data/\*'",
    ):
        sync_files(_session(started), [proj], copy=True, max_bytes=100)
    assert not sync_dir.exists(), "nothing was sent"
    # Neither refusal is remembered: model.py alone is synced, not the rest of proj/.
    report = sync_files(_session(started), [proj / "model.py"])
    assert report.files == 1 and str(proj / "pkg") not in report.used[0], str(report)


def test_what_the_ranks_wrote_stays_and_files_and_folders_may_swap(started, project, capsys):
    proj, sync_dir = project
    out = _sync(started, capsys, "proj --copy --exclude data")
    copy = _on_ranks(started, "__import__('os').path.dirname(__import__('train').__file__)")[0]
    # Written by the ranks beside the synced files: bytecode, a script's output.
    for rel in ("__pycache__/train.cpython-311.pyc", "out.ckpt"):
        os.makedirs(os.path.dirname(os.path.join(copy, rel)), exist_ok=True)
        open(os.path.join(copy, rel), "w").close()
    # model.py becomes a package model/, and pkg/ a module pkg.py.
    (proj / "model.py").unlink()
    (proj / "model").mkdir()
    (proj / "model" / "__init__.py").write_text("VALUE = 'package'\n")
    (proj / "pkg" / "__init__.py").unlink()
    (proj / "pkg").rmdir()
    (proj / "pkg.py").write_text("NAME = 'module'\n")
    out = _sync(started, capsys, "proj")
    assert "1 holds a copy (2 files sent, 34 B, 2 removed)" in out, out
    assert os.path.exists(os.path.join(copy, "out.ckpt"))
    assert os.path.exists(os.path.join(copy, "__pycache__", "train.cpython-311.pyc"))
    assert os.path.isdir(os.path.join(copy, "model")) and os.path.isfile(
        os.path.join(copy, "pkg.py")
    )
    _session(started).run(
        "import sys; sys.modules.pop('model'); sys.modules.pop('pkg')", sink=ListSink()
    )
    assert (
        _on_ranks(started, "(__import__('model').VALUE, __import__('pkg').NAME)")
        == [("package", "module")] * 2
    )


def test_paths_given_first_come_first_and_reload_reaches_the_package(
    started, project, capsys, tmp_path
):
    proj, _ = project
    other = tmp_path / "other"
    (other / "lib").mkdir(parents=True)
    (other / "model.py").write_text("VALUE = 'other'\n")
    (other / "lib" / "__init__.py").write_text("from .core import f\n")
    (other / "lib" / "core.py").write_text("def f():\n    return 1\n")
    _sync(started, capsys, f"{other} proj --copy --exclude data")
    # Both hold model.py: the path given first wins, as in PYTHONPATH.
    _session(started).run("import sys; sys.modules.pop('model', None)", sink=ListSink())
    assert _on_ranks(started, "__import__('model').VALUE") == ["other", "other"]
    assert _on_ranks(started, "__import__('lib').f()") == [1, 1]
    (other / "lib" / "core.py").write_text("def f():\n    return 2\n")
    out = _sync(started, capsys, f"{other} --reload")
    # The package above the changed module is reloaded after it: its `from .core import f`
    # then takes the new f.
    assert "nbdist: reloaded on the ranks: lib, lib.core" in out, out
    assert _on_ranks(started, "__import__('lib').f()") == [2, 2]


def test_one_path_as_a_string_removals_of_two_paths_and_a_copy_that_lost_a_file(
    started, project, tmp_path
):
    proj, _ = project
    other = _folder(tmp_path / "other", {"a.py": "", "b.py": ""})
    session = _session(started)
    # A string is one path (or one pattern), not a list of letters.
    report = sync_files(session, str(proj), exclude="data", copy=True)
    assert report.files == 4, str(report)
    sync_files(session, [other], copy=True)
    (proj / "train.py").unlink()
    (other / "b.py").unlink()
    report = sync_files(session, [proj, other])
    assert "(up to date, 2 removed)" in str(report), str(report)
    # A file the copy lost meanwhile (a /tmp cleaner, a rank's own rm) is sent again.
    os.remove(os.path.join(report.used[0][str(other)], "a.py"))
    assert "(1 file sent, 0 B)" in str(sync_files(session, [other]))
    with pytest.raises(
        NbdistError, match=r"nothing to sync in .*other/: .*by --exclude \*\.py or the default"
    ):
        sync_files(session, [other], exclude="*.py")


def test_a_file_synced_by_name_and_deleted_is_dropped_and_a_restart_keeps_the_rest(
    started, project, tmp_path
):
    proj, _ = project
    single = _folder(tmp_path / "single", {"keep.py": "KEEP = 1\n", "scratch.py": ""})
    session = _session(started)
    sync_files(session, [single / "keep.py", single / "scratch.py"], copy=True)
    (single / "scratch.py").unlink()
    report = sync_files(session, [single / "keep.py"])
    assert report.files == 1 and "1 removed" in str(report), str(report)
    # A restart syncs each path on its own: the others are there for the fresh ranks.
    sync_files(session, [proj], exclude="data")
    (single / "keep.py").unlink()
    with pytest.warns(
        UserWarning,
        match=r"single/ not synced again after the restart \(%dist_sync: nothing to sync",
    ):
        started.run_line_magic("dist_restart", "")
    assert _on_ranks(started, "__import__('model').VALUE") == [1, 1]
