"""%dist_diff's comparison without engines: each "rank" is a value in this process.

The rank-side fingerprints and measurements (nbdist.engine.fingerprint) and
the kernel-side comparison and report (nbdist.driver.diff) are the real ones;
only the transport between them is left out (tests/dist/test_diff.py has it).
"""

from __future__ import annotations

import math

import pytest
import torch
from IPython.core.error import UsageError

from nbdist.driver.diff import COLUMNS, DiffResult, apply_measurement, compare_records
from nbdist.engine import fingerprint
from nbdist.magics.inspect import split_diff_line


def local_diff(values: dict, ref: int = 0, expr: str = "x") -> DiffResult:
    """What %dist_diff reports when rank r's EXPR is values[r]."""
    records = {r: fingerprint.fingerprints(v) for r, v in values.items()}
    differences, pending, n = compare_records(records, ref, expr)
    equal = []
    for diff, path, rank, _ in pending:
        data = fingerprint.reference_data(values[ref], [path])
        found = fingerprint.compare_with(values[rank], data, [path])[path]
        if not apply_measurement(diff, found):
            equal.append(diff)
    kept = [d for d in differences if all(d is not e for e in equal)]
    return DiffResult(expr, ref, sorted(values), n, kept)


def test_equal_tensors_no_rank_differs():
    w = torch.randn(16, 8)
    result = local_diff({0: w, 1: w.clone(), 2: w.clone()}, expr="w")
    assert result.differences == []
    assert result.report() == "no rank differs from rank 0 (ranks 0-2, 1 value compared)"


def test_one_element_different_on_rank_1():
    w = torch.randn(16, 8)
    other = w.clone()
    other[4, 7] += 0.032
    result = local_diff({0: w, 1: other}, expr="{'layer.weight': w}")
    (d,) = result.differences
    assert d.ranks == [1] and d.kind == "values" and d.first_index == (4, 7)
    assert d.max_abs_diff == pytest.approx(0.032, rel=1e-3)
    line = result.report().splitlines()[0]
    assert line.startswith(
        "{'layer.weight': w}: rank 1 differs from rank 0: max |diff| 3.2e-02 at (4, 7)"
    )
    assert "1 of 128 elements differs" in line


def test_first_index_and_max_location_both_reported():
    a = torch.zeros(10)
    b = a.clone()
    b[2], b[6] = 0.1, 5.0
    (d,) = local_diff({0: a, 1: b}).differences
    assert d.first_index == (2,) and d.max_abs_diff == 5.0
    assert "max |diff| 5.0e+00 at (6,); 2 of 10 elements differ, the first at (2,)" in d.detail


@pytest.mark.parametrize(
    "other, kind, words",
    [
        (torch.zeros(4, 7), "shape", "shape (4, 7), rank 0: (4, 8)"),
        (torch.zeros(4, 8, dtype=torch.float64), "dtype", "dtype float64, rank 0: float32"),
        (3.0, "type", "float 3.0, rank 0: a tensor (4, 8) float32"),
    ],
)
def test_shape_dtype_and_type_mismatch(other, kind, words):
    (d,) = local_diff({0: torch.zeros(4, 8), 1: other}).differences
    assert (d.kind, d.detail) == (kind, words)


def test_ranks_that_agree_are_grouped():
    w = torch.ones(3)
    result = local_diff({0: w, 1: w + 1, 2: w.clone(), 3: w + 1}, expr="w")
    (d,) = result.differences
    assert d.ranks == [1, 3]
    assert result.report().startswith("w: ranks 1,3 differ from rank 0: max |diff| 1.0e+00")
    assert (
        result.summary()
        == "1 of 1 value differs on ranks 1,3 (reference rank 0; ranks 0-3 compared)"
    )
    assert [row["rank"] for row in result.rows()] == [1, 3]


def test_reference_rank_can_be_another():
    result = local_diff({0: 1, 1: 2, 2: 2}, ref=1, expr="n")
    (d,) = result.differences
    assert d.ranks == [0] and d.detail == "1, rank 1: 2 (|diff| 1.0e+00)"


def test_nan_equals_nan_in_the_same_place():
    a = torch.tensor([1.0, math.nan, -0.0, math.inf])
    same = torch.tensor([1.0, -math.nan, 0.0, math.inf])  # other NaN bits, other zero sign
    assert local_diff({0: a, 1: same}).differences == []
    moved = torch.tensor([1.0, 2.0, math.nan, math.inf])
    (d,) = local_diff({0: a, 1: moved}).differences
    assert d.first_index == (1,)
    assert "NaN on one rank only at 2 elements" in d.detail
    assert local_diff({0: math.nan, 1: math.nan}).differences == []


def test_numbers_and_strings():
    result = local_diff(
        {0: {"lr": 0.1, "name": "adam", "steps": 3}, 1: {"lr": 0.1, "name": "adamw", "steps": 4}}
    )
    by_path = {d.path: d for d in result.differences}
    assert set(by_path) == {"['name']", "['steps']"}
    assert by_path["['name']"].detail == "'adamw', rank 0: 'adam' (first difference at 4)"
    assert by_path["['steps']"].max_abs_diff == 1.0
    long_a, long_b = "x" * 5000, "x" * 4000 + "y" * 1000
    (d,) = local_diff({0: long_a, 1: long_b}).differences
    assert d.first_index == (4000,) and "first difference at 4000" in d.detail


def test_nested_dicts_with_a_missing_key():
    base = {"state": {0: {"step": 1, "exp_avg": torch.ones(2)}}, "param_groups": [{"lr": 0.1}]}
    other = {"state": {0: {"step": 1}}, "param_groups": [{"lr": 0.1}, {"lr": 0.2}]}
    lines = local_diff({0: base, 1: other}).report().splitlines()
    assert (
        lines[0]
        == "['state'][0]['exp_avg']: rank 1 differs from rank 0: missing (rank 0 has a tensor (2,) float32)"
    )
    # A subtree missing on the reference rank is one line, not one per leaf inside it.
    assert (
        lines[1] == "['param_groups'][1]: rank 1 differs from rank 0: dict of 1, missing on rank 0"
    )
    assert lines[2].startswith("2 of ")


def test_none_and_type_change_of_a_container():
    result = local_diff({0: {"a": None, "b": [1, 2]}, 1: {"a": None, "b": {"x": 1}}})
    (d,) = result.differences  # the dict's items are not reported again
    assert (d.path, d.kind) == ("['b']", "type")


def test_integer_bool_bf16_and_empty_tensors():
    for dtype in (torch.int64, torch.bool, torch.bfloat16, torch.uint8):
        a = torch.zeros(6, dtype=dtype)
        b = a.clone()
        b[5] = 1
        (d,) = local_diff({0: a, 1: b}).differences
        assert d.first_index == (5,) and d.max_abs_diff == 1.0, dtype
    assert local_diff({0: torch.empty(0, 3), 1: torch.empty(0, 3)}).differences == []


def test_rows_have_the_table_columns():
    (row,) = local_diff({0: torch.zeros(2), 1: torch.ones(2)}).rows()
    assert tuple(row) == COLUMNS
    assert row["rank"] == 1 and row["first_index"] == (0,)


def test_fingerprints_are_small_whatever_the_tensor_size():
    ((_, record),) = fingerprint.fingerprints(torch.zeros(1_000_000))
    assert len(repr(record)) < 400 and record["nbytes"] == 4_000_000


@pytest.mark.parametrize(
    "line, parsed",
    [
        ("model.state_dict()", ("model.state_dict()", None, 0)),
        ("w --ranks 0,2", ("w", "0,2", 0)),
        ("--ref 1 w[0] - v", ("w[0] - v", None, 1)),
        ("--ranks=1-3 d['a b'] --ref 2", ("d['a b']", "1-3", 2)),
    ],
)
def test_the_magic_line(line, parsed):
    assert split_diff_line(line) == parsed


@pytest.mark.parametrize(
    "line, message",
    [("", "needs an expression"), ("w --ref x", "--ref 'x'"), ("--ranks 1", "needs an expression")],
)
def test_bad_magic_lines(line, message):
    with pytest.raises(UsageError, match=message):
        split_diff_line(line)


def test_dist_diff_without_a_session_names_dist_start():
    from nbdist.magics.inspect import InspectMagics
    from nbdist.magics.lifecycle import DistMagics

    # Magics of their own, on no shell: nothing registered on the process-wide one.
    magics = InspectMagics(None, DistMagics(None))
    with pytest.raises(UsageError, match="%dist_start"):
        magics.dist_diff("w")


def test_weights_never_broadcast_are_one_line_per_leaf_whatever_the_ranks():
    """Each rank initialised its own model: on every leaf every rank differs from rank 0 by its
    own amount. The report is one line per leaf, each number the range across the ranks (at 256
    ranks it was 100 lines of the first leaf's ranks, then "... and 1430 more")."""
    ranks = 256
    states = {}
    for rank in range(ranks):
        torch.manual_seed(rank)
        layer = torch.nn.Linear(4, 2)
        states[rank] = {"weight": layer.weight.detach(), "bias": layer.bias.detach(), "lr": 0.1}
    result = local_diff(states, expr="state")
    lines = result.report().splitlines()
    assert len(lines) == 3, lines  # weight, bias, the summary
    for path, line in zip(("['weight']", "['bias']"), lines):
        gaps = [d.max_abs_diff for d in result.differences if d.path == path]
        assert len(gaps) == ranks - 1
        worst = max(range(1, ranks), key=lambda r: gaps[r - 1])
        assert line == (
            f"{path}: ranks 1-255 differ from rank 0 (255 different values): "
            f"max |diff| {min(gaps):.1e}–{max(gaps):.1e} (the largest on rank {worst})"
        ), line
    assert (
        lines[-1] == "2 of 3 values differ on ranks 1-255 (reference rank 0; ranks 0-255 compared)"
    )
    assert len(result.rows()) == 2 * (ranks - 1)  # the table keeps every rank's own line


def test_a_few_groups_on_one_leaf_keep_a_line_each():
    w = torch.zeros(4)
    values = {0: w, 1: w + 1, 2: w + 2, 3: w + 3}
    lines = local_diff(values, expr="w").report().splitlines()
    assert [line.split(": max")[0] for line in lines[:3]] == [
        "w: rank 1 differs from rank 0",
        "w: rank 2 differs from rank 0",
        "w: rank 3 differs from rank 0",
    ]


def test_groups_that_differ_in_kind_are_not_folded_together():
    """Four ranks whose shapes differ and four whose values differ: two lines, not one."""
    w = torch.zeros(4)
    values = {0: w}
    values.update({r: torch.zeros(4 + r) for r in range(1, 5)})
    values.update({r: w + r for r in range(5, 9)})
    lines = local_diff(values, expr="w").report().splitlines()
    assert lines[0] == (
        "w: ranks 1-4 differ from rank 0 (4 different values): shape (5–8,), rank 0: (4,)"
    )
    assert lines[1].startswith("w: ranks 5-8 differ from rank 0 (4 different values")
    assert "max |diff| 5.0e+00–8.0e+00" in lines[1], lines[1]
    assert len(lines) == 3
