"""%dist_export: the cells of an interactive run, as a script, give the same model under torchrun.

A real IPython shell runs cells on 2 CPU ranks (one of them interactive-only,
one failing, one on rank 0 only), exports them, and torchrun runs the script
with 2 processes: the final parameters match the interactive run's exactly,
and the script's nbdist.log points land in the run history.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from tests.conftest import run_torchrun

SETUP = """
import os
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
"""
INSPECT = """# nbdist: no-export
print(model)
"""
TRAIN = """
g = torch.Generator().manual_seed(1000 + rank)
for step in range(8):
    x = torch.randn(32, 8, generator=g)
    loss = (model(x) - x[:, :1] * x[:, 1:2]).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    nbdist.log(step=step, loss=loss, samples=len(x))
"""
FAILING = """
if rank == 1:
    raise ValueError("only in the notebook")
"""
SAVE = """
final = [p.detach().clone() for p in model.parameters()]
if rank == 0 and os.environ.get("EXPORT_OUT"):
    torch.save(final, os.environ["EXPORT_OUT"])
"""


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    yield sh
    sh.run_cell("%dist_stop")


def _cell(shell, text, flags=""):
    return shell.run_cell(f"%%on_all_ranks {flags}\n{text}")


def test_exported_cells_train_the_same_model_under_torchrun(shell, tmp_path):
    assert shell.run_cell("%dist_start 2 --cpu").success
    assert _cell(shell, SETUP).success
    assert _cell(shell, INSPECT).success
    assert _cell(shell, TRAIN).success
    assert not _cell(shell, FAILING).success  # failed: not exported
    assert _cell(shell, "seen = True", "--no-export").success
    assert _cell(shell, "only_rank0 = 1", "--ranks 0").success
    assert _cell(shell, SAVE).success
    interactive = shell.run_line_magic("dist_pull", "final --rank 0")
    script = tmp_path / "train.py"
    assert shell.run_cell(f"%dist_export {script}").success
    assert shell.run_cell("%dist_stop").success

    text = script.read_text()
    assert text.count("# --- cell ") == 3
    for code in (SETUP, TRAIN, SAVE):
        assert code.strip() in text
    body = text[text.index("_nbdist_init(") :]
    for left_out in ("print(model)", "only in the notebook", "seen = True", "only_rank0"):
        assert left_out not in body
    # The --ranks cell is named at the top: the script may need it.
    assert "(%%on_all_ranks --ranks 0, 'only_rank0 = 1') is left out" in text

    out = tmp_path / "final.pt"
    history = tmp_path / "history.sqlite"
    env = dict(os.environ, EXPORT_OUT=str(out), NBDIST_HISTORY=str(history), OMP_NUM_THREADS="1")
    returncode, output = run_torchrun(script, 2, env, tmp_path)
    assert returncode == 0, output[-3000:]
    scripted = torch.load(out)
    assert len(scripted) == len(interactive) == 4
    for a, b in zip(interactive, scripted):
        torch.testing.assert_close(b, a, rtol=0, atol=0)

    # nbdist.log under torchrun: both ranks' points are in the run history.
    record = nbdist.runs(str(history))[-1]
    assert (record.world_size, record.label, record.ended is not None) == (2, "train.py", True)
    frame = record.to_pandas()
    assert sorted(frame["rank"].unique()) == [0, 1]
    assert frame.groupby("rank")["step"].max().tolist() == [7, 7]
    assert frame["loss"].notna().all()


def test_an_exported_script_runs_as_one_plain_python_process(tmp_path):
    """Without torchrun: a group of one, nothing listening beyond loopback, metrics still kept."""
    from nbdist.driver.export import export_script

    script = export_script(
        [
            "t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)",
            "for i in range(3):\n    nbdist.log(step=i, loss=float(t.item()) / (i + 1))",
            "print('result', rank, world_size, device, t.item())",
        ],
        str(tmp_path / "one.py"),
    )
    history = tmp_path / "history.sqlite"
    env = dict(os.environ, NBDIST_HISTORY=str(history))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "SLURM_PROCID"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result 0 1 cpu 1.0" in done.stdout
    frame = nbdist.runs(str(history))[-1].to_pandas()
    assert frame["loss"].tolist() == [1.0, 0.5, 1.0 / 3]


TORCHRUN_STYLE = """
import os
dist.init_process_group(backend="gloo")
r = int(os.environ["RANK"])
t = torch.ones(1) * (r + 1)
dist.all_reduce(t)
print(f"sum {r} {t.item()}")
dist.destroy_process_group()
"""
# One string a print: the two processes share torchrun's stdout, and print's separate
# writes of several arguments interleaved ("secondsecond  1 2.0").
AFTER_DESTROY = 't2 = torch.ones(1); dist.all_reduce(t2); print(f"second {rank} {t2.item()}")'


def test_torchrun_style_cells_run_under_torchrun_as_on_the_ranks(tmp_path):
    """A cell's own init_process_group/destroy_process_group meet the script's group, as on a rank.

    Before: ValueError: trying to initialize the default process group twice!
    """
    from nbdist.driver.export import export_script

    script = export_script([TORCHRUN_STYLE, AFTER_DESTROY], str(tmp_path / "tr.py"))
    env = dict(os.environ, NBDIST_HISTORY=str(tmp_path / "h.sqlite"), OMP_NUM_THREADS="1")
    returncode, output = run_torchrun(script, 2, env, tmp_path)
    assert returncode == 0, output[-3000:]
    assert "sum 0 3.0" in output and "sum 1 3.0" in output
    assert "second 0 2.0" in output and "second 1 2.0" in output


T_GLOBALS = """
import torch.distributed as dist
dist.init_process_group("gloo")
def show():
    return "shown by " + str(dist.get_rank())
"""


def test_export_names_what_the_cells_depended_on_and_keeps_the_script_running(
    shell, tmp_path, capsys
):
    """%dist_push, %%on_rank, a magic cell and a failed --noblock cell are named or left out;
    %dist_sync and %dist_run go in as on the ranks: the script runs under torchrun."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "mymodel_exp.py").write_text("def make():\n    return 41\n")
    (tmp_path / "t_globals.py").write_text(T_GLOBALS)
    assert shell.run_cell("%dist_start 2 --cpu").success
    assert shell.run_cell(f"%dist_sync {lib}").success
    assert _cell(shell, "from mymodel_exp import make").success
    assert shell.run_cell(f"%dist_run {tmp_path / 't_globals.py'}").success
    shell.user_ns["lr2"] = 0.01
    assert shell.run_cell("%dist_push lr2").success
    assert shell.run_cell("%%on_rank 0\nonly_rank0 = 1").success
    timed = _cell(shell, "%time z = make() + 1")
    assert timed.success
    run = shell.run_cell('%%on_all_ranks --noblock\nraise RuntimeError("noblock failure")').result
    with pytest.raises(nbdist.RankError):
        run.wait()
    out = tmp_path / "out.txt"
    assert _cell(
        shell, f"if rank == 0:\n    open({str(out)!r}, 'w').write(show() + str(make()))"
    ).success

    script = tmp_path / "train.py"
    capsys.readouterr()
    assert shell.run_cell(f"%dist_export {script}").success
    message = capsys.readouterr().out
    assert "NOTE (also at the top of the script)" in message
    assert "%dist_push lr2) is left out" in message and "%%on_rank 0" in message
    text = script.read_text()
    assert "noblock failure" not in text
    top = text[: text.index("import torch")]
    assert "# NOTE: " in top and "%dist_push lr2) is left out: the ranks got lr2 = 0.01" in top
    assert "(%%on_rank 0, 'only_rank0 = 1') is left out" in top
    assert "is commented out: not plain Python (line 1: '%time z = make() + 1'" in top
    assert f"(%dist_sync {lib}) puts {lib} first on sys.path" in top
    assert "(%dist_run t_globals.py) runs here as on the ranks" in top
    assert "\n# %time z = make() + 1\n" in text

    env = dict(os.environ, NBDIST_HISTORY=str(tmp_path / "h.sqlite"), OMP_NUM_THREADS="1")
    returncode, output = run_torchrun(script, 2, env, tmp_path)
    assert returncode == 0, output[-3000:]
    assert out.read_text() == "shown by 041"
