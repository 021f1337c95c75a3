"""The torch sources the zygote parses before forking are the ones a rank's traceback reads
(nbdist/launch/zygote_imports.py): errors through torch.distributed, a model's forward, a
second backward pass and a loss function's shape check, formatted by IPython in a fresh
process, parse none of them again; and the parse is made only where ranks queue for cores."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import importlib, io, contextlib, sys
import stack_data
import torch, torch.distributed as dist
from IPython.core.interactiveshell import InteractiveShell
from nbdist.launch import zygote_imports as zygote

if sys.argv[1] == "parsed":
    zygote._parse_traceback_sources(zygote.TRACEBACK_SOURCES)
files = {importlib.import_module(n).__file__ for n in zygote.TRACEBACK_SOURCES}
parsed = []
init = stack_data.Source.__init__
def counting(self, filename, *args, **kwargs):
    parsed.append(filename)
    init(self, filename, *args, **kwargs)
stack_data.Source.__init__ = counting
shell = InteractiveShell.instance(colors="nocolor")
shell.user_ns.update(torch=torch, dist=dist)
shown = io.StringIO()
with contextlib.redirect_stdout(shown):
    shell.run_cell("dist.all_reduce(torch.ones(1))")
    shell.run_cell("torch.nn.Linear(2, 2)(torch.ones(3))")
    shell.run_cell("w = torch.ones(2, requires_grad=True); y = (w * 2).sum(); y.backward(); y.backward()")
    shell.run_cell("torch.nn.functional.cross_entropy(torch.randn(4, 3), torch.tensor([0, 1]))")
text = shown.getvalue()
for name in ("distributed_c10d.py", "module.py", "_tensor.py", "graph.py", "functional.py"):
    assert name in text, (name, text)
print(sorted(files & set(parsed)))
"""


@pytest.mark.parametrize("how", ["parsed", "not parsed"])
def test_an_error_through_torch_reads_the_sources_the_zygote_parsed(how):
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    parsed_again = out.stdout.strip()
    if how == "parsed":
        assert parsed_again == "[]", parsed_again
    else:  # the check sees a parse where there is one
        for name in ("distributed_c10d.py", "module.py", "_tensor.py", "graph.py", "functional.py"):
            assert name in parsed_again, (name, parsed_again)


@pytest.mark.parametrize(
    ("forks", "cores", "pays"),
    [
        (8, 2, True),  # 4 ranks a core: each saves 0.1-0.2 CPU-s at an error, on every rank
        (256, 2, True),
        (7, 1, False),  # too few ranks for ~1.4 CPU-s of parse at every start
        (8, 16, False),  # a core per rank: the parse would cost the start more than it saves
        (63, 16, False),
        (64, 16, True),
    ],
)
def test_the_zygote_parses_only_where_ranks_queue_for_cores(forks, cores, pays):
    from nbdist.launch import zygote_imports

    assert zygote_imports.parse_pays(forks, cores) is pays


_WARM_CHECK = """
import contextlib, io, re, sys
import torch.distributed  # imported in the zygote before anything else
from IPython.core.interactiveshell import InteractiveShell
from nbdist.launch import zygote_imports as zygote

if sys.argv[1] == "warmed":
    zygote._format_one_traceback()  # in the zygote, before the fork
shell = InteractiveShell.instance()  # the engine's shell, made after the fork
shell.user_ns["torch"] = torch
# Regular expressions compiled from here on: Python's re module keeps what it compiled.
compiler = getattr(re, "_compiler", None) or __import__("sre_compile")
compiled = []
plain = compiler.compile
compiler.compile = lambda pattern, flags=0: compiled.append(pattern) or plain(pattern, flags)
with contextlib.redirect_stdout(io.StringIO()):
    shell.run_cell("torch.distributed.broadcast(None, src=0)")
assert "Error" in str(shell.last_execution_result.error_in_exec.__class__.__name__)
print(len(compiled))
"""


@pytest.mark.parametrize("how", ["warmed", "cold"])
def test_the_first_traceback_a_fork_formats_finds_the_highlighters_regexes_compiled(how):
    """The zygote formats one traceback before forking (where it parses the sources): a rank's
    first error then compiles none of pygments' ~90 expressions for the Python lexer again."""
    out = subprocess.run(
        [sys.executable, "-c", _WARM_CHECK, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    compiled = int(out.stdout.strip())
    if how == "warmed":
        assert compiled < 10, compiled
    else:  # the check sees the compiles where they are made
        assert compiled > 50, compiled
