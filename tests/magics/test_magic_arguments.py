"""What a user sees from the magics' help and from a bad line, in a real IPython shell.

Most checks need no cluster (a bad line is refused before anything starts);
the one about pulling an undefined name starts 2 CPU ranks.
"""

from __future__ import annotations

import inspect
import re

import pytest
from IPython.core.error import UsageError

from nbdist.magics.inspect import parse_profile_line
from nbdist.magics.scripts import split_run_line

LINE_MAGICS = [
    "dist_start",
    "dist_stop",
    "dist_restart",
    "dist_status",
    "dist_push",
    "dist_pull",
    "dist_where",
    "dist_dashboard",
    "dist_diff",
    "dist_profile",
    "dist_debug",
    "dist_debugpy",
    "dist_last_error",
    "dist_bench",
    "dist_sessions",
    "dist_attach",
    "dist_run",
    "dist_export",
]
CELL_MAGICS = ["on_all_ranks", "on_rank"]


def session_of(shell):
    return shell.magics_manager.registry["DistMagics"].session


@pytest.mark.parametrize("name", LINE_MAGICS)
def test_help_flag_prints_the_line_magics_help(shell, capsys, name):
    shell.run_line_magic(name, "--help")  # no UsageError, nothing started
    out = capsys.readouterr().out
    assert "Example" in out, out
    assert out.strip() == inspect.getdoc(shell.find_line_magic(name))  # as %name? shows it
    assert session_of(shell) is None


@pytest.mark.parametrize("name", CELL_MAGICS)
def test_help_flag_on_a_cell_magic_prints_help_and_runs_nothing(shell, capsys, name):
    # No cluster runs: running the cell would be a UsageError naming %dist_start.
    shell.run_cell_magic(name, "--help", "print('the cell ran')")
    out = capsys.readouterr().out
    assert f"%%{name} [" in out
    assert "Example" in out
    assert "the cell ran" not in out


def test_help_flag_among_other_words_is_help_too(shell, capsys):
    shell.run_line_magic("dist_start", "4 --cpu --help")
    assert "Examples::" in capsys.readouterr().out
    assert session_of(shell) is None


def test_a_scripts_own_help_flag_goes_to_the_script():
    assert split_run_line("train.py --help") == (None, "train.py", ["--help"])


def test_cell_magic_usage_lines_start_with_two_percents(shell):
    assert "%%on_all_ranks [--ranks RANKS]" in shell.find_cell_magic("on_all_ranks").__doc__
    assert "%%on_rank [--noblock]" in shell.find_cell_magic("on_rank").__doc__


def test_dist_start_help_keeps_its_continued_example_on_two_lines(shell):
    doc = shell.find_line_magic("dist_start").__doc__
    # A backslash-newline in the docstring joined the lines with a run of spaces.
    assert not re.search(r"01:00:00 {3,}--launch-opt", doc)
    assert "--time 01:00:00 \\\n" in doc


def test_examples_of_on_rank_push_and_pull_are_indented(shell):
    # As %name? shows the help: a literal block (::) is indented under its paragraph.
    for magic, example in [
        (shell.find_cell_magic("on_rank"), "%%on_rank 0"),
        (shell.find_line_magic("dist_push"), "%dist_push lr"),
        (shell.find_line_magic("dist_pull"), "losses = %dist_pull loss"),
    ]:
        doc = inspect.getdoc(magic)
        line = next(x for x in doc.splitlines() if x.strip() == example)
        assert line.startswith("    "), (example, doc)


@pytest.mark.parametrize(
    "magic, line, message",
    [
        ("dist_where", "--ranks", "argument --ranks: expected one argument; see %dist_where?"),
        ("dist_start", "--bogus", "unrecognized arguments: --bogus; see %dist_start?"),
        ("dist_pull", "", "arguments are required: name; see %dist_pull?"),
        ("dist_bench", "comm --sizes -1K", "'-1K' starts with '-', so it reads as an option"),
        ("dist_sessions", "--stop-idle -2h", "'-2h' starts with '-'"),
    ],
)
def test_a_line_argparse_refuses_points_to_the_magics_help(shell, magic, line, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        shell.run_line_magic(magic, line)
    assert session_of(shell) is None


def test_a_cell_line_argparse_refuses_names_the_cell_magic(shell):
    with pytest.raises(UsageError, match=re.escape("--bogus; see %%on_all_ranks?")):
        shell.run_cell_magic("on_all_ranks", "--bogus", "print(1)")


def test_dist_run_reads_timeout_written_with_equals():
    assert split_run_line("--timeout=5 x.py --lr 1") == ("5", "x.py", ["--lr", "1"])
    with pytest.raises(UsageError, match="--timeout needs seconds"):
        split_run_line("--timeout= x.py")


def test_dist_run_on_a_directory_says_it_is_one(shell, tmp_path):
    with pytest.raises(UsageError, match=f"'{tmp_path}' is a directory: give the path of a script"):
        shell.run_line_magic("dist_run", str(tmp_path))


def test_dist_export_refuses_an_unknown_backend_and_writes_nothing(shell, tmp_path):
    target = tmp_path / "train.py"
    with pytest.raises(UsageError, match=r"--backend 'ncl': use one of nccl, gloo"):
        shell.run_line_magic("dist_export", f"{target} --backend ncl")
    assert not target.exists()


def test_dist_pull_of_an_undefined_name_is_one_line_naming_it(started):
    started.run_cell(
        "%%on_all_ranks\nonly_on_1 = 5 if rank == 1 else None\nif rank == 0: del only_on_1"
    )
    with pytest.raises(UsageError, match=r"%dist_pull 'nosuchvar': not defined on ranks 0-1"):
        started.run_line_magic("dist_pull", "nosuchvar")
    with pytest.raises(UsageError, match=r"'only_on_1': not defined on rank 0\b"):
        started.run_line_magic("dist_pull", "only_on_1")
    assert started.run_line_magic("dist_pull", "only_on_1 --rank 1") == 5
    # A NameError raised while computing a value is not the name missing: left as the rank's error.
    started.run_cell(
        "%%on_all_ranks\nclass Lazy:\n    def __reduce__(self):\n        return undefined_x"
    )
    started.run_cell("%%on_all_ranks\nlazy = Lazy()")
    with pytest.raises(Exception) as info:
        started.run_line_magic("dist_pull", "lazy")
    assert not isinstance(info.value, UsageError)
    assert session_of(started).running


def test_dist_diff_of_an_undefined_name_is_one_line_naming_it(started):
    with pytest.raises(
        UsageError, match=r"%dist_diff: 'no_such_model' is not defined on ranks 0-1"
    ):
        started.run_line_magic("dist_diff", "no_such_model.state_dict()")
    # A NameError inside a function the expression calls, for a name not in it, stays the rank's.
    started.run_cell("%%on_all_ranks\ndef broken():\n    return missing_inside")
    with pytest.raises(Exception) as info:
        started.run_line_magic("dist_diff", "broken()")
    assert not isinstance(info.value, UsageError)
    assert "missing_inside" in str(info.value)


def test_dist_profile_refuses_steps_with_collect():
    with pytest.raises(UsageError, match=r"either N steps .* or --collect"):
        parse_profile_line("3 --collect")
    assert parse_profile_line("--collect") == (None, 1, True)
    assert parse_profile_line("3 --skip 2") == (3, 2, False)
    assert parse_profile_line("3 --skip=0") == (3, 0, False)
    # Not a typo's prefix: --skipper is no --skip.
    with pytest.raises(UsageError, match=r"'--skipper' not understood"):
        parse_profile_line("3 --skipper 2")


def test_dist_push_of_an_unpicklable_value_names_it_and_sends_nothing(started):
    started.user_ns["fine_value"] = 3
    started.user_ns["a_generator"] = (i for i in range(3))
    with pytest.raises(
        UsageError,
        match=r"%dist_push: 'a_generator' cannot be sent to the ranks "
        r"\(cannot pickle 'generator' object\)",
    ):
        started.run_line_magic("dist_push", "fine_value a_generator")
    # One message carries every name: none of them reached the ranks.
    with pytest.raises(UsageError, match="'fine_value': not defined on ranks 0-1"):
        started.run_line_magic("dist_pull", "fine_value")


def test_dist_pull_of_an_unpicklable_value_is_one_line_naming_it(started):
    started.run_cell("%%on_all_ranks\nrank_generator = (i for i in range(3))")
    with pytest.raises(
        UsageError,
        match=r"%dist_pull 'rank_generator': its value on ranks 0-1 cannot be sent to the "
        r"notebook \(cannot pickle 'generator' object\)",
    ):
        started.run_line_magic("dist_pull", "rank_generator")
    assert started.run_line_magic("dist_pull", "rank --rank 1") == 1


def test_dist_debugpy_on_a_port_in_use_is_one_line_and_a_free_port_works_after(started, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            UsageError,
            match=rf"rank 1 cannot listen on 127.0.0.1:{port} \(.*Address already in use\): "
            r".*--port 0",
        ):
            started.run_line_magic("dist_debugpy", f"1 --port {port}")
    capsys.readouterr()
    started.run_line_magic("dist_debugpy", "1")
    assert "rank 1: debugpy listening on 127.0.0.1:" in capsys.readouterr().out


def test_dist_debugpy_on_an_address_not_of_the_rank_host_is_refused_without_a_warning(
    started, capsys
):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): no host has it, so nothing ever listens there.
    # Rank 0: a rank listens once, and the test above leaves rank 1 listening.
    with pytest.raises(
        UsageError,
        match=r"rank 0 cannot listen on 192\.0\.2\.1:0 \(.*\): .*--host must be an address "
        r"of the rank's host",
    ):
        started.run_line_magic("dist_debugpy", "0 --host 192.0.2.1")
    # The beyond-loopback warning is for a port that listens; this one never did.
    assert "warning" not in capsys.readouterr().err


def test_dist_run_of_a_script_that_is_not_python_names_the_line_and_sends_nothing(shell, tmp_path):
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho 'start\n")
    # No cluster runs: the script is refused before the ranks are asked for.
    with pytest.raises(
        UsageError,
        match=rf"%dist_run: {re.escape(str(script))} is not Python: line 2: "
        r"unterminated string literal \(detected at line 2\): echo 'start$",
    ):
        shell.run_line_magic("dist_run", str(script))


def test_dist_export_does_not_overwrite_a_file_it_did_not_write(started, tmp_path, capsys):
    assert started.run_cell("%%on_all_ranks\nexported_value = rank").success
    mine = tmp_path / "train.py"
    mine.write_text("print('my own training script')\n")
    with pytest.raises(
        UsageError, match=r"exists and was not written by %dist_export: .*or add --force"
    ):
        started.run_line_magic("dist_export", str(mine))
    assert mine.read_text() == "print('my own training script')\n"
    started.run_line_magic("dist_export", f"{mine} --force")
    assert "exported_value = rank" in mine.read_text()
    # A script %dist_export wrote before is replaced without --force.
    started.run_cell("%%on_all_ranks\nsecond_value = 2")
    started.run_line_magic("dist_export", str(mine))
    assert "second_value = 2" in mine.read_text()
    assert "nbdist: wrote" in capsys.readouterr().out


def test_quotes_group_a_magics_words_and_are_taken_off(started, shell, tmp_path):
    # IPython's own parser kept them: a name was refused as '"train1"', a path with a space
    # could not be given at all. A quote inside a word stays.
    assert started.run_cell("%%on_all_ranks\nquoted_value = rank").success
    for name in ("my script.py", "o'brien.py"):
        path = tmp_path / name
        started.run_line_magic("dist_export", f'"{path}"' if " " in name else str(path))
        assert "quoted_value = rank" in path.read_text()
    assert started.run_line_magic("dist_pull", "'quoted_value' --rank '1'") == 1
    with pytest.raises(UsageError, match=r"session name 'no good!': use letters"):
        shell.run_line_magic("dist_stop", '"no good!"')
    with pytest.raises(UsageError, match=r"could not parse .*: close the quotes"):
        shell.run_line_magic("dist_pull", '"exported_value')
    with pytest.raises(UsageError, match=r"give one session name, e\.g\. %dist_stop train1"):
        shell.run_line_magic("dist_stop", "one two")


@pytest.mark.parametrize(
    "magic, line, message",
    [
        (
            "dist_where",
            "1",
            "%dist_where '1': name the ranks with --ranks, e.g. %dist_where --ranks 1",
        ),
        ("dist_where", "0-1", "e.g. %dist_where --ranks 0-1"),
        (
            "dist_debug",
            "1",
            "%dist_debug '1': name the rank with --rank, e.g. %dist_debug --rank 1",
        ),
    ],
)
def test_ranks_given_without_their_flag_are_pointed_to_it(shell, magic, line, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        shell.run_line_magic(magic, line)
