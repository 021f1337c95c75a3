"""JupyterLab's debugger switched on before ``%load_ext nbdist`` and ``%dist_start``: a real kernel.

ipykernel's debugger starts debugpy in the kernel with its defaults, under which
every Python process the kernel starts would be a debuggee too; ``%load_ext
nbdist`` undoes that for the processes the kernel starts, so the ranks start as
usual and the gutter's breakpoints stop them.
"""

from __future__ import annotations

from nbdist.driver.lab_debugger import RANKS_THREAD
from tests.debugging.test_lab_debugger import LabDebugClient, _debugger_on, _stack
from tests.notebooks.conftest import Kernel


def test_debugger_on_before_load_ext_then_dist_start():
    kernel = Kernel()
    try:
        dbg = LabDebugClient(kernel)
        cell = "%%on_all_ranks\nq = rank + 100\nprint('q', q)"
        _debugger_on(dbg, cell, [{"line": 2}])  # before nbdist is loaded
        kernel.ok("%load_ext nbdist")
        result = kernel.ok("%dist_start 2 --cpu", timeout=240)
        assert "nbdist: 2 ranks ready" in result.stdout, result.stdout
        # The breakpoint set before nbdist was loaded stops both ranks.
        msg_id = kernel.submit(cell)
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
        tops = _stack(dbg)
        assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} == {2}, tops
        assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
        text = dbg.cell_output(msg_id)
        assert kernel.reply(msg_id)["status"] == "ok"
        assert "q 100" in text and "q 101" in text, text
        # Cells in the kernel still stop at their breakpoints.
        dbg.events.clear()
        here = "a = 1\nb = a + 1\nprint('kernel', b)"
        _debugger_on(dbg, here, [{"line": 2}])
        msg_id = kernel.submit(here)
        stopped = dbg.wait_event("stopped", timeout=60)[0]["body"]
        assert stopped["threadId"] != RANKS_THREAD
        assert dbg.request("continue", threadId=stopped["threadId"])["success"]
        assert "kernel 2" in dbg.cell_output(msg_id)
    finally:
        kernel.shutdown()
