"""nbdist.number_ranges: texts alike but for their numbers, written once with ranges."""

from __future__ import annotations

import pytest

from nbdist.number_ranges import number_shape, with_ranges


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
