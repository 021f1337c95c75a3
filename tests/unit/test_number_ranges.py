"""nbdist.number_ranges: texts alike but for their numbers, written once with ranges."""

from __future__ import annotations

import doctest

import pytest

import nbdist.number_ranges
from nbdist.number_ranges import fold_texts, number_shape, with_ranges


def test_the_modules_examples_hold():
    """The examples in the module's docstrings are what the functions return."""
    failed, tried = doctest.testmod(nbdist.number_ranges)
    assert tried >= 4 and failed == 0


def test_the_shape_masks_each_number_and_keeps_signs_and_words():
    assert number_shape("rank 12 at 10.0.0.7:29500, loss -1.5e-03") == ("rank # at #:#, loss -#")


def test_each_number_is_the_range_of_its_values_in_order_of_value():
    texts = [
        "rank 9 on cuda:1 (3.5 GiB)",
        "rank 10 on cuda:2 (3.5 GiB)",
        "rank 2 on cuda:0 (12.25 GiB)",
    ]
    assert with_ranges(texts) == "rank 2–10 on cuda:0–2 (3.5–12.25 GiB)"


def test_texts_not_alike_are_refused():
    with pytest.raises(ValueError, match="not alike"):
        with_ranges(["step 1", "step 1 of 2"])


def test_ranks_texts_fold_identical_then_alike_beyond_three():
    texts = {rank: f"pid {100 + rank} killed" for rank in range(6)}
    texts[6] = "exit code 1"
    texts[7] = "exit code 1"
    texts[8] = "exit code 2"
    assert fold_texts(texts) == [
        ([0, 1, 2, 3, 4, 5], "pid 100–105 killed"),
        ([6, 7], "exit code 1"),  # two texts alike: each keeps its line
        ([8], "exit code 2"),
    ]


def test_a_number_few_texts_differ_in_keeps_their_lines_apart():
    """Alike texts ranged whole hide which rank had which value where one takes a few values:
    a line for each such value, the many-valued numbers (ranks, pids) ranged within it."""
    texts = {
        rank: f"rank {rank} has [{1 if rank == 3 else 4}], rank 3 has [1]" for rank in range(8)
    }
    texts[3] = "rank 3 has [1], rank 0 has [4]"
    assert fold_texts(texts) == [
        ([0, 1, 2, 4, 5, 6, 7], "rank 0–7 has [4], rank 3 has [1]"),
        ([3], "rank 3 has [1], rank 0 has [4]"),
    ]
    # On two nodes: one line a node, each node's ranks ranged.
    texts = {rank: f"rank {rank} on 10.0.0.{1 + rank // 4} lost" for rank in range(8)}
    assert fold_texts(texts) == [
        ([0, 1, 2, 3], "rank 0–3 on 10.0.0.1 lost"),
        ([4, 5, 6, 7], "rank 4–7 on 10.0.0.2 lost"),
    ]


def test_few_valued_numbers_that_make_many_lines_are_ranged_as_one():
    """Two numbers of two values each make four lines: more than three, so one line."""
    texts = {rank: f"rank {rank}: {rank % 2} and {rank // 4}" for rank in range(8)}
    assert fold_texts(texts) == [(list(range(8)), "rank 0–7: 0–1 and 0–1")]
