"""nbdist.diff and %dist_diff against real engines (2 CPU ranks, gloo)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from nbdist.driver.diff import COLUMNS
from nbdist.driver.sinks import ListSink
from nbdist.engine import rank_diff
from nbdist.errors import RankError


@pytest.fixture(scope="module")
def session():
    with nbdist.DistSession(2, cpu=True, timeout=120) as s:
        yield s


@pytest.fixture()
def shell(session):
    sh = InteractiveShell.instance()
    sh.run_line_magic("load_ext", "nbdist")
    magics = sh.magics_manager.registry["DistMagics"]
    before, magics.session = magics.session, session
    yield sh
    magics.session = before


def run(session, code):
    session.run(code, sink=ListSink())


def nothing_held(session) -> bool:
    run(session, f"held_now = len(__import__({rank_diff.__name__!r}, fromlist=['held']).held)")
    return session.pull("held_now") == [0, 0]


def test_equal_tensors_no_rank_differs(session, shell, capsys):
    run(session, "torch.manual_seed(0); w = torch.randn(64, 32)")
    table = nbdist.diff("w")
    assert list(table.columns) == list(COLUMNS) and len(table) == 0
    shell.run_line_magic("dist_diff", "w")
    assert capsys.readouterr().out == "no rank differs from rank 0 (ranks 0-1, 1 value compared)\n"
    assert nothing_held(session)


def test_one_element_different_on_rank_1(session, shell, capsys):
    run(session, "torch.manual_seed(0); w = torch.randn(64, 32)\nif rank == 1: w[4, 7] += 0.032")
    table = nbdist.diff("{'layer.weight': w}")
    assert table.to_dict("records") == [
        {
            "path": "['layer.weight']",
            "rank": 1,
            "kind": "values",
            "detail": table.detail[0],
            "max_abs_diff": pytest.approx(0.032, rel=1e-3),
            "first_index": (4, 7),
        }
    ]
    shell.run_line_magic("dist_diff", "{'layer.weight': w}")
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "['layer.weight']: rank 1 differs from rank 0: max |diff| 3.2e-02 at (4, 7); "
        "1 of 2048 elements differs",
        "1 of 1 value differs on rank 1 (reference rank 0; ranks 0-1 compared)",
    ]


def test_shape_mismatch(session):
    run(session, "v = torch.zeros(4, 8 - rank)")
    (row,) = nbdist.diff("v").to_dict("records")
    assert row["kind"] == "shape" and row["detail"] == "shape (4, 7), rank 0: (4, 8)"


def test_state_dict_equal_after_ddp_differs_after_a_rank_local_step(session, shell, capsys):
    run(
        session,
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's\n"
        "model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "ddp = DDP(model)\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "x = torch.randn(8, 6, generator=torch.Generator().manual_seed(rank))\n"
        "for _ in range(2):\n"
        "    opt.zero_grad(); ddp(x).pow(2).sum().backward(); opt.step()\n",
    )
    assert len(nbdist.diff("model.state_dict()")) == 0
    assert len(nbdist.diff("opt.state_dict()")) == 0  # nested: state, step, exp_avg...
    # One step on each rank's own gradients (no DDP): the ranks drift apart.
    run(session, "opt.zero_grad(); model(x).pow(2).sum().backward(); opt.step()")
    table = nbdist.diff("model.state_dict()")
    assert set(table.path) == {"['0.weight']", "['0.bias']", "['2.weight']", "['2.bias']"}
    assert set(table["rank"]) == {1} and (table.max_abs_diff > 0).all()
    shell.run_line_magic("dist_diff", "model.state_dict()")
    out = capsys.readouterr().out
    assert "['0.weight']: rank 1 differs from rank 0: max |diff|" in out
    assert (
        out.splitlines()[-1]
        == "4 of 4 values differ on rank 1 (reference rank 0; ranks 0-1 compared)"
    )
    opt_table = nbdist.diff("opt.state_dict()")
    assert "['state'][0]['exp_avg']" in set(opt_table.path)


def test_numbers_and_strings(session):
    run(session, "loss = 0.5 + rank / 100\nname = 'run-' + str(rank)\nsteps = 10")
    table = nbdist.diff("(loss, name, steps)")
    assert list(table.path) == ["[0]", "[1]"]
    assert table.max_abs_diff[0] == pytest.approx(0.01)
    assert table.detail[1] == "'run-1', rank 0: 'run-0' (first difference at 4)"


def test_nested_dict_with_a_missing_key_on_one_rank(session, shell, capsys):
    run(
        session,
        "cfg = {'model': {'width': 64, 'depth': 2}, 'seed': 0}\nif rank == 1: del cfg['model']['depth']",
    )
    shell.run_line_magic("dist_diff", "cfg")
    assert capsys.readouterr().out.splitlines()[0] == (
        "['model']['depth']: rank 1 differs from rank 0: missing (rank 0 has int 2)"
    )


def test_nan_in_the_same_place_is_equal(session):
    run(
        session,
        "n = torch.tensor([1.0, float('nan'), 3.0])\nm = n.clone()\nif rank == 1: m[2] = float('nan')",
    )
    assert len(nbdist.diff("n")) == 0
    (row,) = nbdist.diff("m").to_dict("records")
    assert row["first_index"] == (2,) and "NaN on one rank only at 1 element" in row["detail"]


def test_ranks_and_reference(session, shell, capsys):
    run(session, "k = rank")
    table = nbdist.diff("k", ranks="1")  # rank 0, the reference, is evaluated too
    assert list(table["rank"]) == [1]
    table = nbdist.diff("k", ref=1)
    assert list(table["rank"]) == [0]
    shell.run_line_magic("dist_diff", "k --ref 1")
    assert capsys.readouterr().out.startswith("k: rank 0 differs from rank 1: 0, rank 1: 1")
    with pytest.raises(UsageError, match="rank 5 does not exist"):
        shell.run_line_magic("dist_diff", "k --ranks 5")


def test_an_error_in_the_expression_is_the_cells_rank_error(session, shell):
    with pytest.raises(RankError) as info:
        nbdist.diff("1 / (rank - 1)")
    assert info.value.ranks == [1] and "ZeroDivisionError" in str(info.value)
    assert nothing_held(session)  # rank 0's value was let go too
    with pytest.raises(UsageError, match="not a Python expression"):
        shell.run_line_magic("dist_diff", "w = 3")


def test_list_of_dicts_without_pandas(session, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas fails
    rows = nbdist.diff("rank")
    assert rows == [
        {
            "path": "rank",
            "rank": 1,
            "kind": "values",
            "detail": "1, rank 0: 0 (|diff| 1.0e+00)",
            "max_abs_diff": 1.0,
            "first_index": None,
        }
    ]
