"""JupyterLab's debugger with ranks on other machines (network namespaces): a real kernel.

A rank's debugpy listens on its own machine's loopback, which the kernel cannot
reach, and nbdist opens no debugger port beyond it: the cell's output says which
ranks the debugger is not attached to and why (once per rank process), and the
cell runs through as it would without the debugger. Skipped where network
namespaces cannot be made.
"""

from __future__ import annotations

import warnings

import pytest

from nbdist.driver.lab_debugger import RANKS_THREAD
from tests.debugging.test_lab_debugger import LabDebugClient, _debugger_on
from tests.multihost.netns import namespaces_unavailable
from tests.multihost.test_netns import two_hosts  # noqa: F401 - the fixture
from tests.notebooks.conftest import Kernel

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    warnings.warn(f"multi-host test skipped: {_WHY_NOT}", pytest.PytestWarning, stacklevel=1)
pytestmark = pytest.mark.skipif(
    _WHY_NOT is not None, reason=f"multi-host test needs network namespaces: {_WHY_NOT}"
)


def test_ranks_on_other_machines_are_named_as_not_attached(two_hosts):  # noqa: F811
    hosts, client_file, procs = two_hosts
    kernel = Kernel()
    try:
        dbg = LabDebugClient(kernel)
        kernel.ok("%load_ext nbdist")
        started = kernel.ok(f"%dist_start --connect {client_file} --timeout 120 --cpu", 240)
        assert "4 ranks ready on 2 hosts" in started.stdout, started.stdout
        cell = "%%on_all_ranks\nh = rank\nprint('here', h)"
        _debugger_on(dbg, cell, [{"line": 2}])

        msg_id = kernel.submit(cell)
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok", text
        assert all(f"here {r}" in text for r in range(4)), text
        assert "JupyterLab's debugger is not attached to ranks 0-3, on other machines" in text
        assert f"@{hosts.addresses[0]}: ranks 0-1; " in text, text
        assert f"@{hosts.addresses[1]}: ranks 2-3)" in text, text
        assert "loopback" in text and "%dist_debugpy" in text, text
        assert not [e for e in dbg.events if e.get("event") == "stopped"], dbg.events
        assert RANKS_THREAD not in [t["id"] for t in dbg.request("threads")["body"]["threads"]]

        # Said once per rank process, not at every cell.
        msg_id = kernel.submit(cell)
        text = dbg.cell_output(msg_id, timeout=180)
        assert kernel.reply(msg_id)["status"] == "ok"
        assert "here 3" in text and "not attached" not in text, text
    finally:
        kernel.shutdown()
