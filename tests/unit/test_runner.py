"""How streamed rank output is read from ipyparallel's accumulated text; a broken group's words."""

from __future__ import annotations

import pytest

from nbdist.driver.output import OutputMerger
from nbdist.driver.rank_replies import broken_group_words
from nbdist.driver.rank_streams import stream_delta as _stream_delta
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


_GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"


@pytest.mark.parametrize(
    "error, words",
    [
        # The texts torch 2.13's gloo raised on two CPU ranks, one in all_reduce and one in
        # broadcast, with a 2 s group timeout (the address and port as they were).
        (
            _GLOO + "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete",
            "Timed out waiting 2000ms for recv operation to complete",
        ),
        (
            _GLOO + "pair.cc:553] Connection closed by peer [127.0.0.1]:27337. This is typically "
            "caused by a remote worker crashing. Check the logs of the remote worker before "
            "reporting an error. GLHF!",
            "Connection closed by peer [127.0.0.1]:27337",
        ),
        ("Application timeout caused pair closure", "Application timeout caused pair closure"),
        # A failed read keeps its cause, which follows the address.
        (
            _GLOO + "pair.cc:534] Read error [127.0.0.1]:27337: Connection reset by peer\n"
            "Exception raised from handleReadWrite",
            "Read error [127.0.0.1]:27337: Connection reset by peer",
        ),
        ("NCCL communicator was aborted on rank 1.", "NCCL communicator was aborted"),
        # The user's own words are no broken group.
        ("RuntimeError: Connection reset by peer", ""),
    ],
)
def test_a_broken_groups_words_are_gloos_first_sentence(error, words):
    assert broken_group_words(error) == words
