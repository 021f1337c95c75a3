"""ParallelDims, the placement object of 2D/3D parallelism: its checks run without any process group."""

from __future__ import annotations

import pytest

from nbdist.strategies.parallel.mesh import ParallelDims


def test_product_not_equal_to_world_size_shows_the_numbers_and_a_layout_that_fits():
    with pytest.raises(ValueError) as err:
        ParallelDims(8, dp=2, tp=3, pp=2)
    message = str(err.value)
    assert "dp 2 × tp 3 × pp 2 = 12 ≠ world size 8" in message
    # tp 3 cannot divide 8: the nearest layout keeps dp and pp and halves nothing else.
    assert "e.g. dp 2 × tp 2 × pp 2" in message


def test_suggestion_keeps_tensor_and_pipeline_sizes_when_they_fit():
    with pytest.raises(
        ValueError, match=r"dp 3 × tp 2 × pp 1 = 6 ≠ world size 4.*e\.g\. dp 2 × tp 2 × pp 1"
    ):
        ParallelDims(4, dp=3, tp=2)


def test_dp_minus_one_takes_what_tp_and_pp_leave():
    dims = ParallelDims(8, tp=2, pp=2)
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 2)
    assert dims.shape == (2, 2, 2)  # pp, dp, tp
    assert str(dims) == "dp 2 × tp 2 × pp 2 = 8 ranks"
    assert ParallelDims(4).dp == 4
    with pytest.raises(ValueError, match=r"tp 3 × pp 1 = 3 does not divide world size 8"):
        ParallelDims(8, tp=3)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"tp": 0}, r"tp must be >= 1, got 0 \(1 turns tp off\)"),
        ({"pp": -2}, r"pp must be >= 1, got -2"),
        ({"dp": 0}, r"dp must be >= 1 or -1"),
        ({"tp": 2.0}, r"tp must be an int, got 2\.0"),
        ({"dp": True}, r"dp must be an int, got True"),
    ],
)
def test_bad_sizes_are_named(kwargs, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        ParallelDims(4, **kwargs)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        ParallelDims(0)


def test_coordinates_follow_the_mesh_layout_tp_fastest():
    dims = ParallelDims(8, dp=2, tp=2, pp=2)
    coords = [dims.coordinates(r) for r in range(8)]
    assert coords[0] == {"pp": 0, "dp": 0, "tp": 0}
    assert coords[1] == {"pp": 0, "dp": 0, "tp": 1}  # tensor-parallel partners are neighbours
    assert coords[2] == {"pp": 0, "dp": 1, "tp": 0}
    assert coords[5] == {"pp": 1, "dp": 0, "tp": 1}
    # Each (pp, dp, tp) appears once.
    assert len({tuple(c.values()) for c in coords}) == 8
    with pytest.raises(ValueError, match=r"rank 8 is outside 0\.\.7"):
        dims.coordinates(8)


def test_check_model_names_the_number_that_does_not_fit():
    dims = ParallelDims(8, dp=2, tp=2, pp=2)
    dims.check_model(n_heads=4, hidden=16, n_layers=4, batch=8, n_microbatches=2)
    with pytest.raises(ValueError, match=r"tp 2 must divide the number of attention heads \(3\)"):
        dims.check_model(n_heads=3)
    with pytest.raises(ValueError, match=r"tp 2 must divide the hidden size \(15\)"):
        dims.check_model(hidden=15)
    with pytest.raises(ValueError, match=r"pp 2 stages need at least 2 layers, the model has 1"):
        dims.check_model(n_layers=1)
    with pytest.raises(ValueError, match=r"dp 2 must divide the global batch \(7\)"):
        dims.check_model(batch=7)
    with pytest.raises(ValueError, match=r"each dp replica gets 4 samples .* 3 micro-batches"):
        dims.check_model(batch=8, n_microbatches=3)


def test_parallelize_wants_a_parallel_dims_and_a_process_group():
    from torch import nn

    from nbdist.strategies.parallel.parallelize import parallelize

    with pytest.raises(TypeError, match="dims must be a ParallelDims, got dict"):
        parallelize(nn.Linear(2, 2), {"dp": 1})
    with pytest.raises(RuntimeError, match="parallelize runs on the ranks.*no process group"):
        parallelize(nn.Linear(2, 2), ParallelDims(1))
