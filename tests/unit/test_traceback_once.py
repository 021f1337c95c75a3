"""A failed cell's traceback is formatted once on a rank, and IPython's history keeps the same text.

nbdist/engine/traceback_once.py: IPython 9 formats a failed cell's traceback to show it and
again to store it. A real IPython shell in a fresh process (the shell is a singleton), the
patch installed as a rank's setup does; the formatter counted.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

_CHECK = """
import contextlib, io, json, sys
from IPython.core.interactiveshell import InteractiveShell
from nbdist.engine import traceback_once

shell = InteractiveShell.instance()
if sys.argv[1] == "patched":
    traceback_once.install(shell)
    traceback_once.install(shell)  # idempotent: a second install wraps nothing twice
formats = []
plain = shell.InteractiveTB.structured_traceback
shell.InteractiveTB.structured_traceback = lambda *a, **k: formats.append(1) or plain(*a, **k)
shown = io.StringIO()
said = {}
for name, cell in [
    ("error", "def f(x):\\n    return 1 / x\\nf(0)"),
    ("syntax", "1 +"),
    ("exit", "raise SystemExit(3)"),
]:
    formats.clear()
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(shown):
        result = shell.run_cell(cell, store_history=True)
    count = len(formats)
    stored = shell.history_manager.exceptions[result.execution_count]
    exc = result.error_in_exec or result.error_before_exec
    # What IPython itself makes of the exception, to compare the stored record with.
    own = getattr(shell._format_exception_for_storage, "nbdist_original",
                  shell._format_exception_for_storage)(exc)
    said[name] = {"formats": count, "same": stored == own, "stored": stored}
print(json.dumps(said))
"""


def _run(how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def patched():
    return _run("patched")


def test_a_failed_cells_traceback_is_formatted_once_and_stored_as_ipython_would(patched):
    error = patched["error"]
    assert error["formats"] == 1
    assert error["same"], error["stored"]
    assert error["stored"]["ename"] == "ZeroDivisionError"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(error["stored"]["traceback"]))
    assert "return 1 / x" in text, text  # the frame's line, as the notebook was sent it


def test_without_it_ipython_formats_the_same_traceback_twice():
    # What the patch is for (IPython 9 stores a formatted copy); if a release stops doing
    # so, this says the patch has nothing left to save.
    assert _run("plain")["error"]["formats"] == 2


def test_errors_shown_otherwise_than_stored_are_left_to_ipython(patched):
    # A syntax error's caret, SystemExit's one-line message: IPython's own record for each.
    for name, ename in (("syntax", "SyntaxError"), ("exit", "SystemExit")):
        said = patched[name]
        assert said["same"], (name, said["stored"])
        assert said["stored"]["ename"] == ename
