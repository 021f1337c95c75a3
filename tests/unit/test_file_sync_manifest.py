"""What ``%dist_sync`` would send: the files of a path, the left-out ones, one file at a time."""

from __future__ import annotations

import hashlib
import os

import pytest

from nbdist.driver.file_sync import (
    SyncReport,
    _entries_for,
    _listing,
    _manifest,
    _State,
    _Tally,
)
from nbdist.errors import NbdistError


def _tree(root):
    for rel, text in {
        "a.py": "a",
        "pkg/b.py": "bb",
        "pkg/__pycache__/b.cpython-311.pyc": "x",
        ".git/HEAD": "ref",
        "data/train/x.bin": "0123",
        "notes.ipynb": "{}",
        ".ipynb_checkpoints/notes-checkpoint.ipynb": "{}",
        ".venv/lib/site.py": "v",
    }.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    os.symlink(root / "missing", root / "dangling.py")


def _sent(state, entries):
    return {e.origin: sorted(_manifest(state, _listing(e))) for e in entries}


def test_a_directory_without_caches_environments_and_what_exclude_names(tmp_path):
    _tree(tmp_path)
    state = _State()
    (entry,) = _entries_for(state, [tmp_path], ())
    assert _sent(state, [entry]) == {
        str(tmp_path): ["a.py", "data/train/x.bin", "notes.ipynb", "pkg/b.py"]
    }
    # A relative path pattern and a name pattern; the dangling link is no file.
    (entry,) = _entries_for(state, [tmp_path], ("data/*", "*.ipynb"))
    manifest = _manifest(state, _listing(entry))
    assert sorted(manifest) == ["a.py", "pkg/b.py"]
    assert (
        manifest["pkg/b.py"][0] == 2
        and manifest["pkg/b.py"][2] == hashlib.sha256(b"bb").hexdigest()
    )


def test_files_add_up_per_directory_until_the_directory_itself_is_synced(tmp_path):
    _tree(tmp_path)
    state = _State()
    (first,) = _entries_for(state, [tmp_path / "a.py"], ())
    (second,) = _entries_for(state, [str(tmp_path / "notes.ipynb")], ())
    assert first is second and sorted(_manifest(state, _listing(first))) == ["a.py", "notes.ipynb"]
    (whole,) = _entries_for(state, [tmp_path], ())
    assert whole is first and whole.files is None and len(_manifest(state, _listing(whole))) == 4
    # Another directory is another entry (its copy keeps apart).
    (other,) = _entries_for(state, [tmp_path / "pkg"], ())
    assert other is not first and sorted(_manifest(state, _listing(other))) == ["b.py"]


def test_the_report_says_what_travelled_and_what_is_stale(tmp_path):
    report = SyncReport(
        paths=["src/"],
        files=12,
        bytes=49_152,
        machines=3,
        in_place=1,
        sent_files=1,
        sent_bytes=2048,
        removed=2,
        used={},
        modules={"model": [0, 1]},
        reloaded=False,
        reload_errors={},
    )
    assert str(report) == (
        "nbdist: synced src/ (12 files, 48 KiB) to 3 machines: 1 sees them in place; "
        "2 hold a copy (1 file sent, 2 KiB, 2 removed)\n"
        "nbdist: the ranks imported model before its file changed: %dist_sync --reload reloads it "
        "(or %dist_restart)"
    )


def test_earlier_excludes_hold_until_given_again_and_a_trailing_slash_means_the_folder(tmp_path):
    _tree(tmp_path)
    state = _State()
    _entries_for(state, [tmp_path], ("data",))
    # A file of the same folder synced later, no --exclude: data/ stays out.
    (entry,) = _entries_for(state, [tmp_path / "a.py"], ())
    assert "data/train/x.bin" not in _manifest(state, _listing(entry))
    (entry,) = _entries_for(state, [tmp_path], ("*.ipynb",))
    assert "data/train/x.bin" in _manifest(state, _listing(entry))


def test_linked_folders_are_followed_and_a_link_back_up_is_not_a_loop(tmp_path):
    _tree(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.py").write_text("c")
    os.symlink(tmp_path / "elsewhere", tmp_path / "pkg" / "linked")
    os.symlink(tmp_path / "elsewhere", tmp_path / "pkg" / "again")  # a second link: both
    os.symlink(tmp_path / "pkg", tmp_path / "pkg" / "loop")  # back to the path itself
    os.symlink(
        tmp_path / "pkg" / "linked", tmp_path / "elsewhere" / "back"
    )  # a cycle via two links
    state = _State()
    (entry,) = _entries_for(state, [tmp_path / "pkg"], ())
    assert sorted(_manifest(state, _listing(entry))) == ["again/c.py", "b.py", "linked/c.py"]


def test_a_walk_stops_at_the_file_past_a_limit_naming_it(tmp_path):
    # %dist_sync of a home folder (or of /) is refused as soon as the limit is passed, not
    # after walking everything below it.
    for i in range(10):
        (tmp_path / f"f{i}.py").write_text("x" * 10)
    (entry,) = _entries_for(_State(), [tmp_path], ())
    with pytest.raises(
        NbdistError, match=r"more than 3 files to send \(the last one found: .*f3\.py\)"
    ):
        _listing(entry, _Tally(max_bytes=1 << 30, max_files=3))
    with pytest.raises(
        NbdistError,
        match=r"more than 25 B to send, the limit \(30 B in the first 3 files; largest: .*f\d\.py \(10 B\)",
    ):
        _listing(entry, _Tally(max_bytes=25))
    assert len(_listing(entry, _Tally(max_bytes=100, max_files=10))) == 10
