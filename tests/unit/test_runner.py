"""How streamed rank output is read from ipyparallel's accumulated text."""

from __future__ import annotations

import pytest

from nbdist.driver.output import OutputMerger
from nbdist.driver.runner import _stream_delta
from nbdist.driver.sinks import ListSink


@pytest.mark.parametrize(
    "old, new, delta",
    [
        ("", "a\n", "a\n"),
        ("a\n", "a\nb", "b"),
        ("a\nstep 1", "a\nstep 2", "\rstep 2"),  # ipyparallel rewrote the last line
        ("step 0/3", "done 3/3\n", "\rdone 3/3\n"),
        ("x\ny\n", "x\ny\n", ""),
    ],
)
def test_stream_delta(old, new, delta):
    assert _stream_delta(old, new) == delta


def test_reads_of_a_rewritten_progress_line_end_in_its_final_text():
    sink = ListSink()
    merger = OutputMerger([0], sink)
    seen = ""
    # Successive reads of one rank's accumulated stderr while a bar is drawn.
    for text in ("epoch 1\n10%", "epoch 1\n50%", "epoch 1\n100%\n", "epoch 1\n100%\nnext\n"):
        merger.feed(0, "stderr", _stream_delta(seen, text))
        seen = text
    merger.close()
    assert [e[3] for e in sink.events if e[0] == "line"] == ["epoch 1", "100%", "next"]
