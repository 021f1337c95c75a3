"""Bad arguments on real ranks (2 CPU ranks, gloo): every rank gets the same clear error.

A mistake that only one rank can see (rank 0 makes the checkpoint directory) must
still raise on all of them, instead of leaving the others in a collective until
the group's timeout. The single-process cases are in ``tests/unit/test_api_arguments.py``.
"""

from __future__ import annotations

import pytest
from ranks_with import ranks_with

import nbdist
from nbdist.driver.sinks import ListSink

# Runs a statement on every rank and keeps what it raised (or "ok") as `outcome`.
SETUP = """
import torch
import torch.nn as nn

def outcome_of(fn):
    try:
        fn()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
"""


@pytest.fixture(scope="module")
def session():
    # A short group timeout: a rank left waiting in a collective fails the test in
    # seconds rather than hanging it.
    yield from ranks_with(2, SETUP, timeout=300, history=False, group_timeout=20)


# First in the file: it starts its own session before the module's one exists.
def test_history_given_as_a_path_object_is_where_the_run_goes(tmp_path):
    where = tmp_path / "runs.db"
    # Before: any non-str history (a pathlib.Path) silently meant the default location.
    with nbdist.DistSession(2, cpu=True, timeout=300, history=where) as s:
        s.run("nbdist.log(step=0, loss=1.0)", sink=ListSink())
    assert [run.world_size for run in nbdist.runs(str(where))] == [2]


def _outcomes(session, statement: str) -> list[str]:
    session.run(f"outcome = outcome_of(lambda: {statement})", sink=ListSink(), timeout=120)
    return session.pull("outcome")


def test_save_where_rank0_cannot_write_fails_on_every_rank(session, tmp_path):
    (tmp_path / "ckpt").write_text("a file, not a directory")
    session.push({"path": str(tmp_path / "ckpt" / "step_1")})
    # Before: rank 0 raised NotADirectoryError and rank 1 waited in a barrier.
    outcomes = _outcomes(session, "nbdist.checkpoint.save(path, model=nn.Linear(2, 2), step=1)")
    assert all(o.startswith("CheckpointError: checkpoint ") for o in outcomes), outcomes
    assert all("cannot be written (Not a directory)" in o for o in outcomes), outcomes
    # The group is still usable afterwards.
    session.push({"path": str(tmp_path / "good")})
    assert _outcomes(session, "nbdist.checkpoint.save(path, model=nn.Linear(2, 2))") == [
        "ok",
        "ok",
    ]


def test_save_with_a_path_per_rank_is_refused_on_every_rank(session, tmp_path):
    session.push({"where": str(tmp_path)})
    # Before: accepted; rank 1's shards went to a directory without index or marker,
    # and rank 0's checkpoint lacked them (an FSDP2 model's could not be loaded).
    outcomes = _outcomes(
        session,
        "nbdist.checkpoint.save(f'{where}/rank{nbdist.rank()}', model=nn.Linear(2, 2))",
    )
    assert all("every rank must save to the same directory" in o for o in outcomes), outcomes
    assert all(f"rank 1 '{tmp_path}/rank1'" in o for o in outcomes), outcomes
    assert list(tmp_path.iterdir()) == []


def test_context_parallel_checks_every_buffer_before_cutting_one(session):
    session.run(
        "from nbdist.strategies.parallel.context_parallel import context_parallel\n"
        "x, y = torch.zeros(2, 8), torch.zeros(2, 6)\n"
        "def enter():\n"
        "    with context_parallel(buffers=[x, y], seq_dims=[1, 1], backend='ring'):\n"
        "        pass\n",
        sink=ListSink(),
    )
    outcomes = _outcomes(session, "enter()")
    # 6 tokens do not split into 2 ranks x 2 chunks: y is named, and x is left whole
    # (before: x was already cut to its 4 tokens when y raised).
    assert all(o.startswith("ValueError: buffer 1 (shape (2, 6)): ") for o in outcomes), outcomes
    assert all("pad it to 8" in o for o in outcomes), outcomes
    assert session.pull("tuple(x.shape)") == [(2, 8), (2, 8)]


def test_fsdp_mixed_precision_by_short_name_trains(session):
    session.run(
        "from nbdist.strategies.parallel.fsdp import apply_fsdp\n"
        "torch.manual_seed(0)\n"
        "net = apply_fsdp(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), param_dtype='bf16')\n"
        "out = net(torch.ones(3, 4))\n"
        "out.float().sum().backward()\n"
        "seen = str(out.dtype)\n",
        sink=ListSink(),
        timeout=120,
    )
    # Before: "Invalid device string: 'bf16'" at the first forward.
    assert session.pull("seen") == ["torch.bfloat16", "torch.bfloat16"]


def test_tensor_parallel_width_that_does_not_split_evenly_is_named(session):
    session.run(
        "from nbdist.strategies.parallel.tensor_parallel import apply_tp, device_mesh\n"
        "mlp = nn.Sequential(nn.Linear(8, 5), nn.ReLU(), nn.Linear(5, 8))\n"
        "def shard():\n"
        "    apply_tp(mlp, device_mesh(), colwise=['0'], rowwise=['2'])\n",
        sink=ListSink(),
    )
    outcomes = _outcomes(session, "shard()")
    # Before: accepted; the first forward failed with "a and b must have same reduction dim".
    assert (
        outcomes
        == [
            "ValueError: apply_tp: '0' has out_features=5, which 2 tensor-parallel ranks cannot "
            "split evenly: make it divisible by 2 (e.g. 6), or leave the layer out of colwise/rowwise"
        ]
        * 2
    )
    assert session.pull("type(mlp[0].weight).__name__") == ["Parameter", "Parameter"]


def test_powersgd_rank_given_as_text_is_named(session):
    session.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from nbdist.strategies.optim.compression import apply_comm_hook\n"
        "ddp = DDP(nn.Linear(4, 4))\n",
        sink=ListSink(),
    )
    # Before: "'<' not supported between instances of 'str' and 'int'".
    assert (
        _outcomes(session, "apply_comm_hook(ddp, 'powersgd', matrix_rank='2')")
        == [
            "TypeError: apply_comm_hook: matrix_rank='2' is str, not a number: pass a number, "
            "e.g. matrix_rank=int('2')"
        ]
        * 2
    )
    # Before: accepted; torch's PowerSGD failed at its first compressed step ("empty(): argument
    # 'size' ... must be tuple of ints, not float").
    assert (
        _outcomes(session, "apply_comm_hook(ddp, 'powersgd', matrix_rank=1.5)")
        == [
            "TypeError: apply_comm_hook: matrix_rank=1.5 is no whole number: pass a count, "
            "e.g. matrix_rank=1"
        ]
        * 2
    )
    assert _outcomes(session, "apply_comm_hook(ddp, 'powersgd', matrix_rank=2) and None") == [
        "ok",
        "ok",
    ]


def test_mesh_of_an_unknown_device_type_is_refused(session):
    session.run("from nbdist.strategies.parallel.mesh import ParallelDims\n", sink=ListSink())
    # Before: a DeviceMesh of type 'gpu', failing at its first collective.
    assert (
        _outcomes(session, "ParallelDims(2).build_mesh(device_type='gpu')")
        == [
            "ValueError: device_mesh: device_type='gpu' is no torch device type: give 'cuda' or "
            "'cpu' (or leave it out for this rank's device)"
        ]
        * 2
    )


# Last: before its fix, the uneven reduce-scatter aborted a rank, ending the session.
def test_sequence_parallel_uneven_sequence_is_refused_on_every_rank(session):
    session.run(
        "from nbdist.strategies.parallel.sequence_parallel import apply_sequence_parallel\n"
        "from nbdist.strategies.parallel.tensor_parallel import device_mesh\n"
        "class Block(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)\n"
        "    def forward(self, x):\n"
        "        return x + self.down(torch.relu(self.up(self.norm(x))))\n"
        "sp = apply_sequence_parallel(nn.Sequential(Block(), Block()), device_mesh(), blocks=Block,\n"
        "                             colwise=['up'], rowwise=['down'], norms=['norm'])\n",
        sink=ListSink(),
    )
    outcomes = _outcomes(session, "sp(torch.ones(2, 5, 8))")
    assert all(o.startswith("ValueError: apply_sequence_parallel: the sequence") for o in outcomes)
    assert all(
        "has 5 tokens, which 2 ranks cannot share evenly: pad it to 6" in o for o in outcomes
    )
    assert _outcomes(session, "sp(torch.ones(2, 6, 8))") == ["ok", "ok"]
