"""Unit tests for nbdist.driver.export (cells -> script) and nbdist.engine.standalone's launcher variables."""

from __future__ import annotations

import pytest

from nbdist.driver.export import (
    export_notes,
    export_script,
    exportable_cells,
    note_cell,
    recorded_entry,
    run_script_entry,
    script_text,
)
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


def test_ipython_syntax_is_commented_out_and_named_not_refused():
    # Before: the whole export refused ("cell 2 of the export is not plain Python").
    text = script_text(["a = 1", "!nvidia-smi\nb = 2", "c = 3"])
    compile(text, "train.py", "exec")
    assert "# NOTE: cell 2 is commented out: not plain Python (line 1: '!nvidia-smi'" in text
    assert "\n# !nvidia-smi\n# b = 2\n" in text
    assert "\na = 1\n" in text and "\nc = 3\n" in text


def test_a_recorded_magic_cell_is_named_by_its_in_number():
    entry, warning = recorded_entry("%time z = 2\nprint(z)", "In[7]")
    assert "In[7] is not plain Python (line 1: '%time z = 2')" in warning
    assert "commented out" in warning
    text = script_text(["a = 1", entry])
    compile(text, "train.py", "exec")
    assert "# NOTE: In[7] is commented out: not plain Python" in text
    assert "\n# %time z = 2\n# print(z)\n" in text
    assert recorded_entry("a = 1", "In[8]") == ("a = 1", "")


def test_notes_are_listed_at_the_top_and_their_code_goes_in_place():
    pushed = note_cell("In[3] (%dist_push lr) is left out: lr = 0.1 came from the notebook")
    synced = note_cell(
        "In[4] (%dist_sync lib) puts /x/lib first", "import sys\nsys.path[:0] = ['/x/lib']"
    )
    text = script_text(["a = 1", pushed, synced, "b = 2"])
    compile(text, "train.py", "exec")
    top = text[: text.index("import torch")]
    assert "# NOTE: In[3] (%dist_push lr) is left out: lr = 0.1 came from the notebook\n" in top
    assert "# NOTE: In[4] (%dist_sync lib) puts /x/lib first\n" in top
    assert text.index("a = 1") < text.index("sys.path[:0] = ['/x/lib']") < text.index("b = 2")
    assert text.count("# --- cell ") == 2
    assert exportable_cells(["a = 1", pushed, synced]) == ["a = 1"]
    assert export_notes(["a = 1", pushed]) == [
        "In[3] (%dist_push lr) is left out: lr = 0.1 came from the notebook"
    ]


def test_a_dist_run_cell_becomes_a_run_script_call():
    cell = (
        "__import__('nbdist.engine.scripts', fromlist=['run_script']).run_script("
        "'/w/t.py', ['--lr', '0.1'], get_ipython().user_ns)"
    )
    entry = run_script_entry(cell, "In[5]")
    assert entry.startswith("# nbdist-note: In[5] (%dist_run t.py --lr 0.1) runs here")
    assert "_nbdist_run_script('/w/t.py', ['--lr', '0.1'], globals())" in entry
    assert run_script_entry("x = 1", "In[6]") == ""


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
