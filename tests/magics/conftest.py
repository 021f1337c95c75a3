"""The magics' tests share one real IPython shell per module, with nbdist loaded and no session.

``started`` adds 2 CPU ranks (real engines) to it, stopped when the module ends.
"""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext nbdist")
    # The shell is a process-wide singleton: start from no session, whatever ran before.
    sh.run_line_magic("dist_stop", "")
    sh.magics_manager.registry["DistMagics"].session = None
    yield sh
    sh.run_line_magic("dist_stop", "")


@pytest.fixture(scope="module")
def started(shell):
    result = shell.run_cell("%dist_start 2 --timeout 120 --cpu")
    assert result.success, result.error_in_exec
    return shell
