"""Unit tests for nbdist.driver.export (cells -> script) and nbdist.engine.standalone's launcher variables."""

from __future__ import annotations

import pytest

from nbdist.driver.export import export_script, exportable_cells, script_text
from nbdist.engine.standalone import launcher_environment
from nbdist.errors import NbdistError


@pytest.mark.parametrize(
    "cell",
    [
        "# nbdist: no-export\nprint(model)",
        "print(model)\n#nbdist: no-export",
        "x = 1\n    #  nbdist:  no-export  \n",
    ],
)
def test_marked_cells_are_left_out(cell):
    assert exportable_cells(["a = 1", cell, "b = 2"]) == ["a = 1", "b = 2"]


def test_a_marker_inside_code_text_does_not_count():
    cell = 'note = "# nbdist: no-export"'
    assert exportable_cells([cell]) == [cell]


def test_blank_cells_are_dropped():
    assert exportable_cells(["", "  \n", "a = 1"]) == ["a = 1"]


def test_script_runs_the_cells_in_order_between_init_and_finish():
    text = script_text(["a = rank", "b = a + 1"], ranks=4, name="job.py")
    init = text.index("rank, local_rank, world_size, device = _nbdist_init(None)")
    first, second = text.index("a = rank"), text.index("b = a + 1")
    finish = text.rindex("_nbdist_finish()")
    assert init < first < second < finish
    assert "torchrun --nproc_per_node 4 job.py" in text
    assert "srun python job.py" in text
    compile(text, "job.py", "exec")  # the whole script is valid Python


def test_backend_is_written_into_the_script_when_given():
    assert "_nbdist_init('gloo')" in script_text(["a = 1"], backend="gloo")


def test_ipython_syntax_is_refused_naming_the_line_and_the_fix():
    with pytest.raises(NbdistError) as info:
        script_text(["a = 1", "!nvidia-smi\nb = 2"])
    message = str(info.value)
    assert "cell 2" in message
    assert "'!nvidia-smi'" in message
    assert "# nbdist: no-export" in message


def test_a_marked_magic_cell_is_fine():
    text = script_text(["a = 1", "# nbdist: no-export\n%timeit a + 1"])
    assert "timeit" not in text


def test_export_writes_the_file(tmp_path):
    path = export_script(["a = 1"], str(tmp_path / "train.py"))
    assert path == str(tmp_path / "train.py")
    assert "a = 1" in (tmp_path / "train.py").read_text()


def test_export_needs_a_python_file_name(tmp_path):
    with pytest.raises(NbdistError, match=r"train\.txt.*e\.g\. train\.py"):
        export_script(["a = 1"], str(tmp_path / "train.txt"))
    # Before: a file named "None", and a raw FileNotFoundError.
    with pytest.raises(TypeError, match=r"export to None: give the script's path"):
        export_script(["a = 1"], None)
    with pytest.raises(NbdistError, match=r"there is no directory .*nodir: make it first"):
        export_script(["a = 1"], tmp_path / "nodir" / "train.py")
    assert not (tmp_path / "nodir").exists()


def test_export_with_nothing_recorded_says_why(tmp_path):
    with pytest.raises(NbdistError, match=r"nothing to export: .*session\.record_cell\(code\)"):
        export_script(["# nbdist: no-export\nprint(1)"], str(tmp_path / "t.py"))
    assert not (tmp_path / "t.py").exists()


def test_export_can_refuse_to_overwrite(tmp_path):
    target = tmp_path / "t.py"
    target.write_text("keep")
    with pytest.raises(NbdistError, match="exists"):
        export_script(["a = 1"], str(target), overwrite=False)
    assert target.read_text() == "keep"


# --------------------------------------------------------------------------- launchers


def test_torchrun_variables_pass_through():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
        "OTHER": "x",
    }
    out = launcher_environment(env)
    assert out == {k: v for k, v in env.items() if k != "OTHER"}


def test_srun_variables_become_torchrun_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "MASTER_ADDR": "node1",
    }
    assert launcher_environment(env) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
    }


def test_srun_without_master_addr_names_the_fix():
    with pytest.raises(RuntimeError, match="export MASTER_ADDR="):
        launcher_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})


def test_plain_python_is_a_single_rank():
    assert launcher_environment({"HOME": "/root"}) == {}
