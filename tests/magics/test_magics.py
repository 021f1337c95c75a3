"""The magics in a real IPython shell with real engines (2 CPU ranks)."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import nbdist


def run(shell, text):
    result = shell.run_cell(text)
    return result


@pytest.mark.parametrize(
    "line, message",
    [
        ("0", "number of ranks '0'"),
        ("-3", "number of ranks '-3'"),
        ("two", "number of ranks 'two'"),
        ("2 --backend mpi", "unknown backend 'mpi'"),
        ("2 --backend nccl", "backend 'nccl' needs GPUs"),
        ("--gpus 0", "GPU 0 is not visible"),
        ("--gpus a,b", "--gpus 'a,b' is not a list"),
        ("--threads 0", "--threads '0'"),
        ("--timeout -5", "--timeout '-5' must be more than 0"),
        ("--timeout 0", "--timeout '0' must be more than 0"),
        ("--bogus", "unrecognized arguments: --bogus"),
        ("2 --cpu --gpus 0", "--cpu and --gpus contradict"),
        ("2 --idle-timeout 1h", "--idle-timeout 1h ends a named session: add --name NAME"),
        ("2 --name a --idle-timeout soon", "--idle-timeout 'soon' is not a duration"),
    ],
)
def test_bad_dist_start_input_is_a_usage_error(shell, line, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        shell.run_line_magic("dist_start", line)
    assert shell.magics_manager.registry["DistMagics"].session is None


def test_bad_stop_idle_is_a_usage_error(shell):
    with pytest.raises(UsageError, match="--stop-idle '0' must be more than 0"):
        shell.run_line_magic("dist_sessions", "--stop-idle 0")
    with pytest.raises(
        UsageError, match="--stop-idle 'later' is not a duration.*e.g. --stop-idle 30m"
    ):
        shell.run_line_magic("dist_sessions", "--stop-idle later")


def test_connect_names_the_file_and_attach_is_its_deprecated_name(shell):
    before = shell.magics_manager.registry["DistMagics"].session
    missing = "--connect '/nonexistent/cluster-x.json': no such file"
    with pytest.raises(UsageError, match=missing):
        shell.run_line_magic("dist_start", "--connect /nonexistent/cluster-x.json")
    # --attach FILE still works for one release, and says what replaces it.
    with pytest.warns(FutureWarning, match="use %dist_start --connect /nonexistent/cluster-x.json"):
        with pytest.raises(UsageError, match=missing):
            shell.run_line_magic("dist_start", "--attach /nonexistent/cluster-x.json")
    with pytest.raises(UsageError, match="give the connection file once, with --connect FILE"):
        shell.run_line_magic("dist_start", "--attach a.json --connect b.json")
    assert "--connect" in shell.find_line_magic("dist_start").__doc__
    assert shell.magics_manager.registry["DistMagics"].session is before


def test_dist_attach_bad_timeout_is_a_usage_error_naming_it(shell):
    before = shell.magics_manager.registry["DistMagics"].session
    with pytest.raises(
        UsageError, match="--timeout 'abc' is not a number of seconds, e.g. --timeout 60"
    ):
        shell.run_line_magic("dist_attach", "train1 --timeout abc")
    for value in ("0", "-1", "nan"):
        with pytest.raises(UsageError, match=f"--timeout '{value}' must be more than 0 seconds"):
            shell.run_line_magic("dist_attach", f"train1 --timeout {value}")
    assert shell.magics_manager.registry["DistMagics"].session is before


def test_cells_before_start_are_refused(shell):
    if shell.magics_manager.registry["DistMagics"].session is not None:
        pytest.skip("a cluster is already running in this shell")
    with pytest.raises(
        UsageError, match="no nbdist cluster is running: start one with %dist_start"
    ):
        shell.run_cell_magic("on_all_ranks", "", "print(1)")
    with pytest.raises(UsageError, match="%dist_start"):
        shell.run_line_magic("dist_status", "")


def test_on_all_ranks_streams_labelled_output(started, capsys):
    result = run(
        started, "%%on_all_ranks\nt = torch.ones(2) * rank\ndist.all_reduce(t)\nprint(rank, t)"
    )
    assert result.success
    out = capsys.readouterr().out
    assert "[rank 0] 0 tensor([1., 1.])" in out
    assert "[rank 1] 1 tensor([1., 1.])" in out


def test_identical_output_once_and_on_rank(started, capsys):
    run(started, "%%on_all_ranks\nprint('hello from all')")
    assert capsys.readouterr().out.count("hello from all") == 1
    run(started, "%%on_rank 1\nprint('only', rank)")
    assert capsys.readouterr().out.strip() == "[rank 1] only 1"
    run(started, "%%on_all_ranks --ranks 0-1\nprint('both')")
    assert "[ranks 0-1] both" in capsys.readouterr().out


def test_a_failing_rank_fails_the_cell(started, capsys):
    result = run(started, "%%on_all_ranks\nvalue = 1 / (rank - 1)")
    assert not result.success
    assert isinstance(result.error_in_exec, nbdist.RankError)
    assert result.error_in_exec.ranks == [1]
    out = capsys.readouterr().out
    assert "[rank 1] ZeroDivisionError: division by zero" in out
    assert "1 of 2 ranks failed" in out
    # The cell after a failure works, and rank 0's state from the failed cell is kept.
    assert run(started, "%%on_all_ranks\nok = True").success
    assert started.run_line_magic("dist_pull", "value --rank 0") == -1.0


def test_bad_cell_flags(started):
    with pytest.raises(UsageError, match="rank 7 does not exist"):
        started.run_cell_magic("on_all_ranks", "--ranks 7", "pass")
    with pytest.raises(UsageError, match="ranks 'x' not understood"):
        started.run_cell_magic("on_all_ranks", "--ranks x", "pass")
    with pytest.raises(UsageError, match="--timeout 'soon'"):
        started.run_cell_magic("on_all_ranks", "--timeout soon", "pass")
    with pytest.raises(UsageError, match="rank 9 does not exist"):
        started.run_cell_magic("on_rank", "9", "pass")


def test_push_and_pull(started):
    started.user_ns["lr"] = 0.25
    started.run_line_magic("dist_push", "lr")
    assert started.run_line_magic("dist_pull", "lr") == [0.25, 0.25]
    run(started, "%%on_all_ranks\nmine = rank * 2")
    assert started.run_line_magic("dist_pull", "mine --rank 1") == 2
    with pytest.raises(UsageError, match="'nope' is not defined in the notebook"):
        started.run_line_magic("dist_push", "nope")
    with pytest.raises(UsageError, match="--rank 'x'"):
        started.run_line_magic("dist_pull", "mine --rank x")


def test_status_table(started, capsys):
    import time

    # The controller's queue counts lag the last reply by a moment under load: wait for idle.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        started.run_line_magic("dist_status", "")
        out = capsys.readouterr().out.splitlines()
        if all(" idle " in row for row in out[1:]):
            break
        time.sleep(0.2)
    assert out[0].split() == [
        "rank",
        "host",
        "pid",
        "device",
        "backend",
        "state",
        "memory",
        "dropped",
    ]
    assert [row.split()[0] for row in out[1:]] == ["0", "1"]
    assert all(" gloo " in row and " idle " in row for row in out[1:])
    assert all(row.split()[-1] == "0" for row in out[1:])  # no metrics point lost


def test_start_while_running_changes_nothing(started):
    before = started.magics_manager.registry["DistMagics"].session
    with pytest.raises(UsageError, match="already running: %dist_stop or %dist_restart first"):
        started.run_line_magic("dist_start", "3 --cpu")
    assert started.magics_manager.registry["DistMagics"].session is before
    assert before.world_size == 2


def test_noblock_returns_a_waitable_run(started):
    run_ = started.run_cell_magic(
        "on_all_ranks", "--noblock", "import time; time.sleep(0.5); z = rank"
    )
    assert run_.wait() is not None
    assert started.run_line_magic("dist_pull", "z") == [0, 1]


def test_a_cell_queued_behind_a_noblock_cell_says_so(started, capsys):
    # Before: it waited silently for the earlier cell (49 s in a review, --timeout counting).
    earlier = started.run_cell_magic("on_rank", "1 --noblock", "import time; time.sleep(2)")
    capsys.readouterr()
    run(started, "%%on_all_ranks\nqueued = rank")
    assert earlier.done()
    out = capsys.readouterr().out
    assert (
        "nbdist: rank 1 still runs the --noblock cell started earlier; this cell runs there "
        "after it (interrupt the kernel to stop both)"
    ) in out, out
    run(started, "%%on_all_ranks\nagain = rank")  # the earlier cell is done: nothing said
    assert "--noblock" not in capsys.readouterr().out


def test_restart_gives_fresh_ranks(started, capsys):
    run(started, "%%on_all_ranks\nleftover = 1")
    old = {r.pid for r in started.magics_manager.registry["DistMagics"].session.ranks}
    started.run_line_magic("dist_restart", "")
    out = capsys.readouterr().out
    assert "nbdist: restarted 2 ranks in " in out
    assert "names defined in cells are gone" in out
    session = started.magics_manager.registry["DistMagics"].session
    assert {r.pid for r in session.ranks}.isdisjoint(old)
    result = run(started, "%%on_all_ranks\nprint('leftover' in globals(), world_size)")
    assert result.success
    assert "[ranks 0-1] False 2" in capsys.readouterr().out


def test_help_texts_have_examples(shell):
    for name in (
        "dist_start",
        "dist_stop",
        "dist_status",
        "dist_restart",
        "dist_push",
        "dist_pull",
    ):
        doc = shell.find_line_magic(name).__doc__
        assert "Example" in doc, name
    for name in ("on_all_ranks", "on_rank"):
        assert "Example" in shell.find_cell_magic(name).__doc__, name
    assert "--backend" in shell.find_line_magic("dist_start").__doc__


def test_dashboard_outside_a_notebook_is_a_text_summary(started, capsys):
    run(
        started,
        "%%on_all_ranks\nfor i in range(30):\n    nbdist.log(step=i, loss=0.5 + rank, samples=4)",
    )
    # The cell returned with every rank's last point in the run.
    metrics = nbdist.current_session().metrics
    assert [metrics.last(r)["step"] for r in (0, 1)] == [29, 29]
    capsys.readouterr()  # a terminal shell shows no dashboard by itself
    started.run_line_magic("dist_dashboard", "")
    out = capsys.readouterr().out
    assert "loss" in out
    assert len([line for line in out.splitlines() if line.lstrip().startswith(("0 ", "1 "))]) >= 2
    with pytest.raises(UsageError, match="run 'x'"):
        started.run_line_magic("dist_dashboard", "x")
    with pytest.raises(UsageError, match="is not in the history"):
        started.run_line_magic("dist_dashboard", "987654")
