"""Code written for torchrun, unchanged, on real ranks (2 CPU ranks, gloo).

A torchrun script with argparse, its own ``init_process_group`` and
``destroy_process_group``, run by ``%dist_run`` and by ``exec`` in a cell; the
next cell's collective must still work. The ranks carry torchrun's whole
environment contract, and a script's group calls that ask for another group
fail naming the conflict.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbdist.driver.sinks import ListSink
from nbdist.errors import RankError

SCRIPT = textwrap.dedent(
    """
    import argparse
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=2)
        parser.add_argument("--tag", default="none")
        args = parser.parse_args()
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(4, 1, bias=False))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(args.steps):
            x = torch.full((8, 4), float(rank + 1))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        global weight, tag
        weight, tag = model.module.weight.detach().clone(), args.tag
        print("done", rank, args.steps, args.tag)
        dist.destroy_process_group()


    if __name__ == "__main__":
        main()
    """
)

# torchrun's LocalElasticAgent sets these on every worker (torch 2.13).
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def _expected_weight(steps: int) -> torch.Tensor:
    """One process, the same SGD on the mean of both ranks' gradients (DDP averages them)."""
    torch.manual_seed(0)
    w = torch.nn.Linear(4, 1, bias=False).weight.detach().clone()
    # d(sum(x @ w.T))/dw = column sums of x: 8 * (rank + 1) per entry; mean over ranks 1, 2.
    grad = torch.full_like(w, 8 * 1.5)
    for _ in range(steps):
        w -= 0.1 * grad
    return w


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    sh.run_line_magic("dist_stop", "")
    sh.magics_manager.registry["DistMagics"].session = None
    result = sh.run_cell("%dist_start 2 --cpu --timeout 120")
    assert result.success, result.error_in_exec
    folder = tmp_path_factory.mktemp("script")
    (folder / "train.py").write_text(SCRIPT)
    sh.user_ns["script_path"] = str(folder / "train.py")
    yield sh
    sh.run_line_magic("dist_stop", "")


def _session(sh):
    return sh.magics_manager.registry["DistMagics"].session


def _collective_works(sh):
    s = _session(sh)
    s.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)", sink=ListSink())
    assert [t.item() for t in s.pull("t")] == [3.0, 3.0]


def test_dist_run_gives_the_script_its_arguments_and_keeps_its_globals(shell, capsys):
    path = shell.user_ns["script_path"]
    result = shell.run_cell(f"%dist_run {path} --steps 3 --tag 'a b'")
    assert result.success, result.error_in_exec
    out = capsys.readouterr()
    assert "[rank 0] done 0 3 a b" in out.out and "[rank 1] done 1 3 a b" in out.out
    # Its own init and destroy met nbdist's group, and said so once.
    assert "init_process_group: nbdist's process group is already up" in out.err
    assert "destroy_process_group() leaves nbdist's process group up" in out.err
    s = _session(shell)
    for weight in s.pull("weight"):  # the script's globals stay on the ranks
        torch.testing.assert_close(weight, _expected_weight(3), rtol=0, atol=1e-6)
    assert s.pull("tag") == ["a b", "a b"]
    _collective_works(shell)


def test_the_same_script_exec_in_a_cell_then_a_collective(shell):
    s = _session(shell)
    s.run(
        # As pasted: a cell's sys.argv is ['-c'], which the script's argparse accepts.
        f"exec(open({shell.user_ns['script_path']!r}).read())",
        sink=ListSink(),
    )
    for weight in s.pull("weight"):
        torch.testing.assert_close(weight, _expected_weight(2), rtol=0, atol=1e-6)
    _collective_works(shell)


def test_a_failing_argparse_fails_the_cell_with_its_status(shell):
    path = shell.user_ns["script_path"]
    result = shell.run_cell(f"%dist_run {path} --unknown 1")
    assert isinstance(result.error_in_exec, RankError)
    text = str(result.error_in_exec)
    assert text.startswith("ranks 0-1: ScriptExit:") and "exited with status 2" in text
    _collective_works(shell)


def test_dist_run_refuses_a_missing_script_naming_it(shell):
    with pytest.raises(UsageError, match="no file 'nowhere.py'"):
        shell.run_line_magic("dist_run", "nowhere.py --x 1")
    with pytest.raises(UsageError, match="needs a script"):
        shell.run_line_magic("dist_run", "")


def test_ranks_carry_torchruns_contract_and_look_launched_by_it(shell):
    s = _session(shell)
    s.run(
        "import os, sys\n"
        f"env = {{k: os.environ.get(k) for k in {TORCHRUN_VARIABLES!r}}}\n"
        "launched = dist.is_torchelastic_launched()\n"
        "argv, interactive = list(sys.argv), hasattr(sys, 'ps1')\n",
        sink=ListSink(),
    )
    envs = s.pull("env")
    for rank, env in enumerate(envs):
        missing = [k for k, v in env.items() if v is None]
        assert not missing, f"rank {rank} lacks {missing}"
        assert (env["RANK"], env["ROLE_RANK"], env["LOCAL_RANK"]) == (str(rank),) * 3
        assert (env["WORLD_SIZE"], env["ROLE_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2",) * 3
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == (
            "0",
            "1",
            "default",
        )
    assert envs[0]["TORCHELASTIC_RUN_ID"] == envs[1]["TORCHELASTIC_RUN_ID"]
    assert s.pull("launched") == [True, True]
    assert s.pull("argv") == [["-c"], ["-c"]]
    assert s.pull("interactive") == [False, False]


def test_an_init_asking_for_another_group_names_the_conflict(shell):
    s = _session(shell)
    with pytest.raises(RankError) as info:
        s.run("dist.init_process_group('gloo', world_size=4)", sink=ListSink())
    text = str(info.value)
    assert "GroupConflict" in text and "world_size=4, but nbdist started 2 ranks" in text
    s.run("dist.init_process_group(backend='gloo')", sink=ListSink())  # matching: served
    _collective_works(shell)


SIBLING_SCRIPT = textwrap.dedent(
    """
    import os
    import sys

    import helper_beside


    def main():
        global made, version, data
        made = "in main"
        version = helper_beside.VERSION
        with open("data.txt") as f:  # relative: the notebook's directory, as python would
            data = f.read().strip()
        if os.environ.get("FAIL_NOW") == "1":
            raise ValueError("failed after making things")
        return 0


    if __name__ == "__main__":
        sys.exit(main())
    """
)


def test_dist_run_is_python_script_py_beside_its_modules_and_keeps_globals_after_exit(
    shell, tmp_path, monkeypatch
):
    # Before: the module beside the script did not import (ModuleNotFoundError), an edited
    # one ran as first imported, data.txt was looked for in the ranks' start directory
    # after %cd, and sys.exit(main()) or an error lost every global the script made.
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "train.py").write_text(SIBLING_SCRIPT)
    (folder / "helper_beside.py").write_text("VERSION = 1\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_text("from the notebook's directory\n")
    monkeypatch.chdir(work)  # the kernel's %cd
    s = _session(shell)
    started_in = s.pull("__import__('os').getcwd()")
    result = shell.run_cell(f"%dist_run {folder / 'train.py'}")
    assert result.success, result.error_in_exec
    assert s.pull("(made, version, data)") == [("in main", 1, "from the notebook's directory")] * 2
    # Edited between two runs: read again, as a new python process would.
    (folder / "helper_beside.py").write_text("VERSION = 2  # edited\n")
    assert shell.run_cell(f"%dist_run {folder / 'train.py'}").success
    assert s.pull("version") == [2, 2]
    # A script that raises still leaves what it made to inspect.
    s.run("del made", sink=ListSink())
    s.run("import os; os.environ['FAIL_NOW'] = '1'", sink=ListSink())
    failed = shell.run_cell(f"%dist_run {folder / 'train.py'}")
    assert isinstance(failed.error_in_exec, RankError)
    assert "failed after making things" in str(failed.error_in_exec)
    assert s.pull("made") == ["in main", "in main"]
    s.run("os.environ.pop('FAIL_NOW')", sink=ListSink())
    assert s.pull("os.getcwd()") == started_in  # the notebook's directory for the run only
    _collective_works(shell)


def test_exit_and_quit_in_a_script_end_it_as_under_python(shell, tmp_path):
    # Before: IPython hides the builtins exit and quit while a cell runs, and a script's
    # `exit()` failed on every rank with "NameError: name 'exit' is not defined".
    script = tmp_path / "ends_early.py"
    script.write_text(
        "import sys\nmade = 'before the exit'\nif '--fail' in sys.argv:\n    quit(4)\nexit()\n"
        "made = 'never'\n"
    )
    s = _session(shell)
    result = shell.run_cell(f"%dist_run {script}")
    assert result.success, result.error_in_exec
    assert s.pull("made") == ["before the exit"] * 2
    failed = shell.run_cell(f"%dist_run {script} --fail")
    assert isinstance(failed.error_in_exec, RankError)
    assert str(failed.error_in_exec).startswith("ranks 0-1: ScriptExit:")
    assert "exited with status 4" in str(failed.error_in_exec)
    # The rank's own exit() is still the one that fails a cell without ending the rank.
    with pytest.raises(RankError, match="ExitOnRank"):
        s.run("exit()", sink=ListSink())
    _collective_works(shell)
