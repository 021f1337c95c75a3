"""Unit tests for nbdist.rank: the helpers code on a rank calls (rank, device, print0, seeding)."""

from __future__ import annotations

import random

import pytest
import torch

from nbdist.engine.devices import device_for
from nbdist.engine.helpers import (
    _state,
    device,
    local_rank,
    print0,
    rank,
    rank_zero_first,
    seed_all,
    world_size,
)

ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_rank(monkeypatch):
    """No process-group state and no torchrun variables, restored afterwards."""
    saved = dict(_state)
    _state.clear()
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    _state.clear()
    _state.update(saved)


def test_defaults_outside_a_distributed_job():
    assert rank() == 0
    assert local_rank() == 0
    assert world_size() == 1


def test_values_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert rank() == 5
    assert local_rank() == 1
    assert world_size() == 8


def test_empty_environment_values_fall_back_to_defaults(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.setenv(name, "")
    assert (rank(), local_rank(), world_size()) == (0, 0, 1)


def test_state_set_by_nbdist_wins_over_environment(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    _state.update(rank=2, local_rank=0, world_size=3)
    assert rank() == 2
    assert local_rank() == 0
    assert world_size() == 3


def test_state_value_zero_is_not_mistaken_for_missing(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    _state["rank"] = 0
    assert rank() == 0


def test_device_for():
    assert device_for(None) == "cpu"
    # Every rank of a host sees the same GPUs, as under torchrun: the index is the rank's own.
    assert device_for(0) == "cuda:0"
    assert device_for(2) == "cuda:2"


def test_device_from_state():
    _state["device"] = "cpu"
    assert device() == torch.device("cpu")


def test_device_is_cpu_outside_a_job_without_state():
    if torch.cuda.is_available():
        pytest.skip("the fallback picks a GPU when CUDA is available")
    assert device() == torch.device("cpu")


def test_print0_prints_on_rank_zero(capsys):
    _state["rank"] = 0
    print0("loss", 1.5, sep="=")
    assert capsys.readouterr().out == "loss=1.5\n"


def test_print0_is_silent_on_other_ranks(capsys):
    _state["rank"] = 1
    print0("loss", 1.5)
    assert capsys.readouterr().out == ""


def test_print0_follows_environment_rank(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    print0("hidden")
    monkeypatch.setenv("RANK", "0")
    print0("shown")
    assert capsys.readouterr().out == "shown\n"


def test_seed_all_adds_the_rank():
    _state["rank"] = 3
    assert seed_all(10) == 13


def test_seed_all_makes_torch_reproducible():
    _state["rank"] = 3
    seed_all(10)
    first = torch.rand(5)
    seed_all(10)
    second = torch.rand(5)
    assert torch.equal(first, second)


def test_seed_all_gives_ranks_different_streams():
    _state["rank"] = 0
    seed_all(10)
    rank0 = torch.rand(5)
    _state["rank"] = 1
    seed_all(10)
    rank1 = torch.rand(5)
    assert not torch.equal(rank0, rank1)


def test_seed_all_matches_manual_seed_of_seed_plus_rank():
    _state["rank"] = 3
    seed_all(10)
    got = torch.rand(3)
    torch.manual_seed(13)
    assert torch.equal(got, torch.rand(3))


def test_seed_all_seeds_python_random():
    _state["rank"] = 2
    seed_all(7)
    first = [random.random() for _ in range(3)]
    random.seed(9)
    assert first == [random.random() for _ in range(3)]


def test_seed_all_seeds_numpy():
    np = pytest.importorskip("numpy")
    _state["rank"] = 1
    seed_all(4)
    first = np.random.rand(3)
    seed_all(4)
    assert (first == np.random.rand(3)).all()


@pytest.mark.parametrize("r", [0, 2])
def test_rank_zero_first_without_process_group_just_runs(r):
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    _state["rank"] = r
    ran = []
    with rank_zero_first():
        ran.append(rank())
    assert ran == [r]


def test_rank_zero_first_lets_exceptions_through():
    with pytest.raises(RuntimeError, match="download failed"):
        with rank_zero_first():
            raise RuntimeError("download failed")
