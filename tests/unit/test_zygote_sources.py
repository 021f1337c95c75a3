"""The torch sources the zygote parses before forking are the ones a rank's traceback reads
(nbdist/launch/zygote.py): an error through torch.distributed in IPython, formatted in a
fresh process, parses none of them again."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import importlib, io, contextlib, sys
import stack_data
import torch, torch.distributed as dist
from IPython.core.interactiveshell import InteractiveShell
from nbdist.launch import zygote

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
text = shown.getvalue()
assert "distributed_c10d.py" in text and "module.py" in text, text
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
        assert "distributed_c10d.py" in parsed_again and "module.py" in parsed_again, parsed_again
