"""``%dist_start --check-collectives`` in a real IPython shell: the ranks compare each collective.

(What a mismatch then says: tests/faults/test_collective_arguments.py.)
"""

from __future__ import annotations


def test_check_collectives_flag_reaches_the_ranks_and_the_ready_line_says_so(shell, capsys):
    result = shell.run_cell("%dist_start 2 --cpu --timeout 120 --check-collectives")
    try:
        assert result.success, result.error_in_exec
        said = capsys.readouterr()
        assert "each collective is compared across the ranks before it runs" in said.out + said.err
        result = shell.run_cell("%%on_all_ranks\nlevel = str(dist.get_debug_level())")
        assert result.success, result.error_in_exec
        assert shell.run_line_magic("dist_pull", "level") == ["DebugLevel.DETAIL"] * 2
    finally:
        shell.run_line_magic("dist_stop", "")


def test_start_help_names_check_collectives(shell, capsys):
    shell.run_line_magic("dist_start", "--help")
    out = capsys.readouterr().out
    assert "--check-collectives" in out and "kind, shapes and dtypes" in out, out
