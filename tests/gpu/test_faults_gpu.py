"""Faults on GPU ranks: CUDA out of memory on one rank, a rank that hangs in NCCL, a rank that raises.

Each ends in a named failure, and the next cell works on every rank without a restart.
"""

from __future__ import annotations

import re

import pytest

from nbdist.driver.runner import CellTimeout
from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError
from tests.gpu.conftest import two_nccl_ranks_reason

_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"([0-9.]+) (bytes|KiB|MiB|GiB)"
HELD_BYTES = 256 * 2**20


def _bytes(number: str, unit: str) -> float:
    return float(number) * _UNITS[unit]


def _reduce_works(session) -> None:
    """An all_reduce of CUDA tensors on every rank gives the exact sum (small integers in float32)."""
    session.run(
        "t = torch.full((1024,), float(rank + 1), device=device)\n"
        "dist.all_reduce(t)\n"
        "total = t.sum().item()\n",
        sink=ListSink(),
    )
    n = session.world_size
    assert session.pull("total") == [1024 * n * (n + 1) / 2] * n


def test_cuda_oom_on_one_rank_names_it_and_the_next_cell_works(start_session):
    """Rank 1 asks for more than its GPU holds: the cell fails naming rank 1, its GPU and the
    memory in use; the other rank and the rank's earlier tensors are untouched; the next cell
    (1 GiB on every rank, an all_reduce) works.

    The failure is CUDA's own out-of-memory error (``torch.OutOfMemoryError``) from a single
    allocation of twice the GPU's capacity: it fails at once, and fills nothing that the rank
    sharing the GPU would miss. Reference for "memory in use": the rank's own
    ``torch.cuda.memory_allocated()`` when it failed, which the message must report as
    "allocated by PyTorch" (to the two decimals it prints).
    """
    s = start_session(2, group_timeout=120)
    gpu_of = {slot.rank: slot.gpu for slot in s.placement.slots}
    s.run(
        f"held = torch.ones({HELD_BYTES}, dtype=torch.uint8, device=device)\n"
        "torch.cuda.synchronize()\n",
        sink=ListSink(),
    )
    with pytest.raises(RankError) as info:
        s.run(
            "import os\n"
            "if rank == 1:\n"
            "    allocated_then = torch.cuda.memory_allocated()\n"
            "    too_much = 2 * torch.cuda.get_device_properties(0).total_memory\n"
            "    hog = torch.empty(too_much, dtype=torch.uint8, device=device)\n",
            sink=ListSink(),
        )
    err = info.value
    assert err.ranks == [1]
    [failure] = err.failures
    assert failure.ename in ("OutOfMemoryError", "torch.OutOfMemoryError"), failure
    text = str(err)
    assert text.startswith("rank 1: ") and "CUDA out of memory" in text, text
    # The GPU as the user numbers it (nvidia-smi, CUDA_VISIBLE_DEVICES), not the rank's cuda:0.
    assert re.search(rf"\bGPU {gpu_of[1]}\b", text), f"GPU {gpu_of[1]} not named: {text}"
    by_torch = re.search(rf"Of the allocated memory {_SIZE} is allocated by PyTorch", text)
    in_use = re.search(rf"this process has {_SIZE} memory in use", text)
    assert by_torch and in_use, text
    allocated_then = s.pull("allocated_then", rank=1)
    assert allocated_then >= HELD_BYTES
    unit = _UNITS[by_torch.group(2)]
    assert abs(_bytes(*by_torch.groups()) - allocated_then) <= 0.005 * unit, text
    assert _bytes(*in_use.groups()) >= allocated_then  # the CUDA context comes on top

    # The next cell works on every rank, and nothing was lost.
    s.run(
        "big = torch.ones(2**30, dtype=torch.uint8, device=device)\n"
        "sums = (int(big.sum().item()), int(held.sum().item()))\n"
        "del big\n",
        sink=ListSink(),
    )
    assert s.pull("sums") == [(2**30, HELD_BYTES)] * 2
    _reduce_works(s)


@pytest.fixture
def nccl_pair(start_session):
    """Two ranks over NCCL (one per GPU, or both on one GPU with NCCL >= 2.30).

    The group's own timeout is 120 s: a rank left waiting past it would be torn down by
    NCCL's watchdog, so these tests show that nbdist acts well before.
    """
    reason = two_nccl_ranks_reason()
    if reason:
        pytest.skip(reason)
    s = start_session(2, group_timeout=120)
    assert s.backend == "nccl"
    return s


def test_a_hung_rank_is_named_within_the_cell_timeout_over_nccl(nccl_pair):
    """Rank 1 hangs before a barrier that rank 0 waits in: with ``--timeout 5`` the cell
    ends with nbdist's CellTimeout, which names rank 1 as the one that never entered the
    barrier and rank 0 as waiting inside it; both ranks stay alive (NCCL's watchdog, due
    at the group timeout, never fired) and the next collective works.

    Named failure: ``CellTimeout`` with ``rank 1: never entered barrier #N``.
    """
    s = nccl_pair
    pids = [r.pid for r in s.ranks]
    with pytest.raises(CellTimeout) as info:
        s.run(
            "import time\ndist.barrier()\nif rank == 1:\n    time.sleep(600)\ndist.barrier()\n",
            timeout=5,
            sink=ListSink(),
        )
    text = str(info.value)
    found = re.search(r"rank 0: inside barrier #(\d+) for ", text)
    assert found, text
    seq = int(found.group(1))
    assert f"rank 1: never entered barrier #{seq} (last: barrier #{seq - 1}," in text, text
    assert "time.sleep(600)" in text  # where rank 1 was
    # NCCL's flight recorder, read from the group itself, agrees: rank 1 is behind.
    assert "flight recorder (the process group's last collectives" in text, text
    assert "rank 1 is behind: its last collective is #" in text, text
    assert s.dead_ranks() == {}
    assert [r.pid for r in s.ranks] == pids
    _reduce_works(s)


def test_a_failing_rank_releases_the_other_from_nccl_and_state_survives(nccl_pair):
    """Rank 1 raises while rank 0 waits in an NCCL all_reduce: the cell fails naming rank 1
    and its error, rank 0 is released (not blamed), tensors kept on the GPU survive, and the
    group works again.

    Named failure: ``RankError`` for rank 1, ``ValueError: rank 1 broke``.
    """
    s = nccl_pair
    s.run("kept = torch.full((4,), float(rank), device=device)", sink=ListSink())
    with pytest.raises(RankError) as info:
        s.run(
            "t = torch.ones(4, device=device)\n"
            "if rank == 1:\n"
            "    raise ValueError('rank 1 broke')\n"
            "dist.all_reduce(t)\n"
            "torch.cuda.synchronize()\n",
            sink=ListSink(),
        )
    assert info.value.ranks == [1]
    assert str(info.value).startswith("rank 1: ValueError: rank 1 broke")
    assert "the others were released: rank 0 from" in str(info.value)
    s.run("t = kept.clone()\ndist.all_reduce(t)\ntotal = t.sum().item()", sink=ListSink())
    assert s.pull("total") == [4.0, 4.0]  # 4 × (0 + 1): rank 0's zeros and rank 1's ones


def test_the_flight_recorder_records_nccl_collectives_with_their_state(start_session):
    """One NCCL rank (any one-GPU machine): after two all_reduces, the rank's flight recorder
    lists them in order with their sizes, and NCCL reports the finished one as completed."""
    s = start_session(1)
    assert s.backend == "nccl"
    s.run(
        "from nbdist.engine import flight_recorder\n"
        "t = torch.ones(1000, device=device)\n"
        "dist.all_reduce(t)\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n"
        "fr = flight_recorder.recent(2)\n",
        sink=ListSink(),
    )
    (fr,) = s.pull("fr")
    assert [e["op"] for e in fr] == ["all_reduce", "all_reduce"]
    assert fr[1]["seq"] == fr[0]["seq"] + 1
    assert fr[0]["sizes"] == [[1000]]
    assert fr[0]["state"] == "completed"


def test_a_barrier_on_one_rank_alone_is_released_naming_the_rank_that_skipped_it(start_session):
    """Rank 0 calls ``dist.barrier()`` alone (two ranks on the GPU(s): gloo with CUDA tensors
    on one GPU, NCCL on two), the others finish the cell: within the cell's 60 s ``--timeout``
    (the group's is 120 s) the cell fails with ``CollectiveMismatch`` naming rank 1, and the
    next collective works.

    Named failure: ``CollectiveMismatch: waited in barrier #N for rank 1, which finished the
    cell without entering it``; the note names the DDP wrapper made with the old group.
    """
    s = start_session(2, group_timeout=120)
    # A DDP wrapper on the GPU holds the group (NCCL's, or gloo's): the note names it.
    s.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "ddp = DDP(torch.nn.Linear(4, 4).to(device))\n",
        sink=ListSink(),
    )
    with pytest.raises(RankError) as info:
        s.run("if rank == 0:\n    dist.barrier()\n", timeout=60, sink=ListSink())
    [failure] = info.value.failures
    assert (failure.rank, failure.ename) == (0, "CollectiveMismatch"), str(info.value)
    assert re.fullmatch(
        r"waited in barrier #\d+ for rank 1, which finished the cell without entering it",
        failure.evalue,
    ), failure.evalue
    assert "The process group was formed again" in str(info.value)
    assert str(info.value).endswith(
        "make them again before using them: ddp (DistributedDataParallel)."
    ), str(info.value)
    _reduce_works(s)
