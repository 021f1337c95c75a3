"""10 MB of stdout and 10 MB of stderr from a rank in one cell: no deadlock, a visible truncation note."""

from __future__ import annotations

import pytest

import nbdist
from nbdist.driver.sinks import ListSink

TEN_MB = (
    "import sys\n"
    "line = 'x' * 99 + '\\n'\n"
    "if rank == 0:\n"
    "    sys.stdout.write(line * 100_000)\n"
    "    sys.stderr.write(line * 100_000)\n"
    "print('done', rank)\n"
)


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120, history=False) as s:
        yield s


def _lines(sink, stream):
    return [e[3] for e in sink.events if e[0] == "line" and e[1] == stream]


def test_huge_output_is_truncated_with_a_note_and_nothing_blocks(session):
    sink = ListSink()
    session.run(TEN_MB, sink=sink)
    out, err = _lines(sink, "stdout"), _lines(sink, "stderr")
    note = "nbdist: {} truncated after 1.0 MiB in this cell; the rest is not shown"
    assert any(text.startswith(note.format("stdout")) for text in out)
    assert any(text.startswith(note.format("stderr")) for text in err)
    # What was dropped is counted: 10 MB written, about 1 MiB shown.
    assert any(t.startswith("nbdist: 8.") and t.endswith("MiB of stdout not shown") for t in out)
    assert any(t.startswith("nbdist: 8.") and t.endswith("MiB of stderr not shown") for t in err)
    shown = sum(len(t) + 1 for t in out if t == "x" * 99)
    assert 0.9 * 2**20 < shown <= 2**20
    # Rank 1's output is not held up, and the next cell runs normally.
    sink = ListSink()
    session.run("print('next', rank)", sink=sink)
    assert _lines(sink, "stdout") == ["next 0", "next 1"]


def test_without_a_limit_every_line_arrives(session, monkeypatch):
    monkeypatch.setenv("NBDIST_OUTPUT_LIMIT", "0")
    sink = ListSink()
    session.run(TEN_MB, sink=sink)
    out, err = _lines(sink, "stdout"), _lines(sink, "stderr")
    assert out.count("x" * 99) == 100_000
    assert err.count("x" * 99) == 100_000
    assert "done 0" in out


def test_a_warning_from_cell_code_folds_across_ranks(session):
    """Each rank's warning names its own /tmp/ipykernel_<pid>/<hash>.py: still one line."""
    sink = ListSink()
    session.run("import warnings\nwarnings.warn('careful now')\nprint('after warn')", sink=sink)
    [fold] = sink.folds
    warning = [(label, text) for stream, label, text in fold if "UserWarning" in text]
    assert len(warning) == 1, fold
    label, text = warning[0]
    assert label == "ranks 0-1"
    assert "ipykernel_" in text and text.endswith(":2: UserWarning: careful now")
    # The text shown is rank 0's own line.
    assert text in nbdist.output(rank=0, stream="stderr").splitlines()
    assert text not in nbdist.output(rank=1, stream="stderr").splitlines()  # another process
