"""A synced file's two paths in JupyterLab's debugger: the notebook's, and a rank's copy."""

from __future__ import annotations

from nbdist.driver.lab_debug_paths import RankPaths


def _breakpoints(path: str, lines=(3,)) -> dict:
    return {"source": {"path": path}, "breakpoints": [{"line": n} for n in lines]}


def test_a_breakpoint_goes_to_both_paths_on_a_rank_with_a_copy_and_as_is_elsewhere():
    paths = RankPaths()
    assert paths.update({0: {"/home/u/proj": "/tmp/c/1-proj"}, 1: {}}) == [0]
    sent = paths.to_rank(0, _breakpoints("/home/u/proj/pkg/m.py"))
    assert [a["source"]["path"] for a in sent] == [
        "/home/u/proj/pkg/m.py",
        "/tmp/c/1-proj/pkg/m.py",
    ]
    assert sent[1]["breakpoints"] == [{"line": 3}]
    # Another rank, another file, a path that only starts like the synced one.
    assert paths.to_rank(1, _breakpoints("/home/u/proj/m.py")) == [
        _breakpoints("/home/u/proj/m.py")
    ]
    assert len(paths.to_rank(0, _breakpoints("/home/u/proj2/m.py"))) == 1
    # A removal (no lines) reaches both paths too.
    assert len(paths.to_rank(0, _breakpoints("/home/u/proj/m.py", ()))) == 2


def test_nested_synced_paths_each_get_the_breakpoint_and_frames_come_back_by_the_longest():
    paths = RankPaths()
    paths.update({0: {"/a": "/tmp/c/x-a", "/a/src": "/tmp/c/y-src"}})
    # A file in both: each copy gets the breakpoint (a rank may import it through either).
    sent = [a["source"]["path"] for a in paths.to_rank(0, _breakpoints("/a/src/m.py"))]
    assert sent == ["/a/src/m.py", "/tmp/c/x-a/src/m.py", "/tmp/c/y-src/m.py"]
    sent = [a["source"]["path"] for a in paths.to_rank(0, _breakpoints("/a/m.py"))]
    assert sent == ["/a/m.py", "/tmp/c/x-a/m.py"]
    frame = {"id": 7, "source": {"path": "/tmp/c/y-src/m.py", "name": "m.py"}, "line": 3}
    assert paths.from_rank(0, frame)["source"] == {"path": "/a/src/m.py", "name": "m.py"}
    assert paths.from_rank(1, frame) is frame  # a rank without copies: untouched
    # The rank's copies gone (a restart without them): its frames and breakpoints as they are.
    assert paths.update({0: {}}) == [0]
    assert paths.from_rank(0, frame) is frame
