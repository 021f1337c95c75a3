"""JupyterLab's debugger on the ranks, around the cells that run them: a real kernel, 2 CPU ranks.

What the user sees for a script run by ``%dist_run`` (its breakpoints stop the
ranks, also the fresh ranks of a ``%dist_restart``), a step off a cell's last
line (the cell ends; no stop in nbdist's own code), a cell whose last line is
only spaces (its breakpoints still stop the ranks), a ``--noblock`` cell whose
ranks stay paused after the kernel's cell returned, a cell's ``--timeout``
behind ranks that still run an earlier cell, the Pause button while a
ranks cell runs, and a cell on a rank that died.
"""

from __future__ import annotations

import os
import signal
import time

from nbdist.driver.lab_debugger import RANKS_THREAD
from tests.conftest import wait_gone
from tests.debugging.test_lab_debugger import (
    LabDebugClient,
    _debugger_on,
    _select_all,
    _stack,
    _stop_ranks_in,
)
from tests.debugging.test_lab_debugger_ranks import _idle


def _stderr(dbg: LabDebugClient, msg_id: str) -> str:
    return "".join(
        m["content"].get("text", "")
        for m in dbg.other
        if m["parent_header"].get("msg_id") == msg_id
        and m["msg_type"] == "stream"
        and m["content"].get("name") == "stderr"
    )


def _stops(dbg: LabDebugClient) -> list[dict]:
    dbg._drain()
    return [e for e in dbg.events if e.get("event") == "stopped"]


def test_breakpoint_in_a_dist_run_script_stops_the_ranks_first_thing(lab, tmp_path):
    # First in the module: no ranks cell ran with the debugger on before.
    kernel, dbg = lab
    script = tmp_path / "lab_debug_script.py"
    script.write_text(
        "import torch.distributed as dist\nr = dist.get_rank()\nv = r * 7\nprint('script', r, v)\n"
    )
    _debugger_on(dbg, "x = 1", [])
    assert dbg.request("setBreakpoints", source={"path": str(script)}, breakpoints=[{"line": 3}])[
        "success"
    ]
    for attempt in ("first", "after %dist_restart"):
        dbg.events.clear()
        msg_id = kernel.submit(f"%dist_run {script}")
        dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
        tops = _stack(dbg)
        assert sorted(tops) == [0, 1], (attempt, tops)
        assert {(f["source"]["path"], f["line"]) for f in tops.values()} == {(str(script), 3)}
        _select_all(dbg)
        assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
        text = dbg.cell_output(msg_id)
        assert kernel.reply(msg_id)["status"] == "ok", attempt
        assert "script 0 0" in text and "script 1 7" in text, (attempt, text)
        if attempt == "first":
            # New rank processes: their debugpy is attached by the next run, too.
            restarted = kernel.submit("%dist_restart")
            dbg.cell_output(restarted, timeout=240)
            assert kernel.reply(restarted)["status"] == "ok"
    assert dbg.request("setBreakpoints", source={"path": str(script)}, breakpoints=[])["success"]


def test_next_on_a_cells_last_line_ends_the_cell(lab):
    kernel, dbg = lab
    cell = "%%on_all_ranks\na1 = rank\na2 = a1 + 1"
    msg_id = _stop_ranks_in(kernel, dbg, cell, 3)
    _select_all(dbg)
    dbg.events.clear()
    assert dbg.request("next", threadId=RANKS_THREAD)["success"]
    deadline = time.monotonic() + 60
    while not _idle(dbg, msg_id) and not _stops(dbg) and time.monotonic() < deadline:
        time.sleep(0.1)
    stops = _stops(dbg)
    if stops:  # where they stopped (nbdist's own end of cell, before the fix)
        where = [(f["name"], f["source"]["path"]) for f in _stack(dbg).values()]
        _select_all(dbg)
        dbg.request("continue", threadId=RANKS_THREAD)
        dbg.cell_output(msg_id)
        raise AssertionError(f"Next off the cell's last line stopped at {where}")
    assert kernel.reply(msg_id)["status"] == "ok"
    # The step does not carry over into the ranks' next cell either.
    msg_id = kernel.submit("%%on_all_ranks\nprint('after', a2)")
    text = dbg.cell_output(msg_id)
    assert "after 1" in text and "after 2" in text, text
    assert not _stops(dbg), dbg.events


def test_breakpoint_in_a_cell_whose_last_line_is_only_spaces(lab):
    kernel, dbg = lab
    # JupyterLab indents the line after a block: the cell's text keeps the spaces.
    cell = "%%on_all_ranks\nx = rank\nfor i in range(2):\n    x += i\nprint('spaces', x)\n    "
    msg_id = _stop_ranks_in(kernel, dbg, cell, 4, timeout=60)
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} == {4}, tops
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    # Stops again in the loop's second pass: continue that one too.
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=4, timeout=60)
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert "spaces 1" in text and "spaces 2" in text, text
    assert "cannot match" not in _stderr(dbg, msg_id)


def test_a_ranks_cell_the_debugger_cannot_match_says_so(lab):
    kernel, dbg = lab
    dbg.events.clear()
    # A cell magic's cell whose text does not end with what the ranks run.
    cell = "%%time\nget_ipython().run_cell_magic('on_all_ranks', '', 'q = rank\\n')"
    _debugger_on(dbg, cell, [{"line": 2}])
    msg_id = kernel.submit(cell)
    dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    said = _stderr(dbg, msg_id)
    assert "cannot match this cell's lines" in said, said


def test_a_noblock_cells_ranks_stay_paused_after_the_kernel_returns(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "%%on_all_ranks --noblock\nw = rank + 3\nprint('noblock', w)"
    _debugger_on(dbg, cell, [{"line": 2}])
    msg_id = kernel.submit(cell)
    dbg.cell_output(msg_id)  # the kernel is free at once
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    time.sleep(2)
    dbg._drain()
    assert not [e for e in dbg.events if e.get("event") == "continued"], dbg.events
    threads = dbg.request("threads")["body"]["threads"]
    assert RANKS_THREAD in [t["id"] for t in threads], threads
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} == {2}, tops
    _select_all(dbg)
    reply = dbg.request("continue", threadId=1)  # JupyterLab's Continue
    assert reply["success"], reply
    dbg.wait_event("continued", threadId=RANKS_THREAD, timeout=30)
    msg_id = kernel.submit("%%on_all_ranks\nprint('then', w)")
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "then 3" in text and "then 4" in text, text


def test_timeout_of_a_cell_queued_behind_busy_ranks_holds(lab):
    kernel, dbg = lab
    dbg.events.clear()
    busy = "%%on_all_ranks --noblock\nimport time\ntime.sleep(40)\nprint('busy done')"
    _debugger_on(dbg, busy, [])
    dbg.cell_output(kernel.submit(busy))
    started = time.monotonic()
    msg_id = kernel.submit("%%on_all_ranks --timeout 5\nprint('behind', rank)")
    dbg.cell_output(msg_id, timeout=90)
    took = time.monotonic() - started
    reply = kernel.reply(msg_id)
    assert reply["status"] == "error" and reply["ename"] == "CellTimeout", reply
    assert took < 25, f"the 5 s --timeout ended the cell after {took:.0f} s"
    # The ranks are usable again.
    msg_id = kernel.submit("%%on_all_ranks\nprint('usable', rank)")
    assert "usable 1" in dbg.cell_output(msg_id, timeout=90)


def test_pause_while_a_ranks_cell_runs_pauses_the_ranks(lab):
    kernel, dbg = lab
    dbg.events.clear()
    cell = (
        "%%on_all_ranks\nimport time\nfor i in range(150):\n    time.sleep(0.2)\n"
        "print('looped', rank, i)"
    )
    _debugger_on(dbg, cell, [])
    # Nothing runs: nothing to pause, and the reply says so.
    idle_pause = dbg.request("pause", threadId=RANKS_THREAD)
    assert not idle_pause["success"] and idle_pause.get("message"), idle_pause
    msg_id = kernel.submit(cell)
    time.sleep(3)
    reply = dbg.request("pause", threadId=1, timeout=15)  # JupyterLab's Pause
    assert reply["success"], reply
    stops = dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=30)
    assert {e["body"]["reason"] for e in stops} == {"pause"}, stops
    assert not [e for e in _stops(dbg) if e["body"]["threadId"] != RANKS_THREAD], dbg.events
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} <= {3, 4}, tops
    _select_all(dbg)
    assert dbg.request("continue", threadId=1)["success"]
    text = dbg.cell_output(msg_id, timeout=120)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "looped 0 149" in text and "looped 1 149" in text, text


def test_a_rank_paused_without_its_stopped_event_is_shown_stopped(lab):
    # A rank paused at a breakpoint whose "stopped" event never reaches the kernel
    # (seen under load, cause unknown) left the cell waiting with nothing to continue.
    # Rank 1's debugpy is made to drop that one event (the message it would send is
    # replaced by pydevd's own "send nothing" once); rank 0's arrives as usual.
    kernel, dbg = lab
    dbg.events.clear()
    cell = (
        "%%on_all_ranks\nimport pydevd\n"
        "from _pydevd_bundle.pydevd_net_command import NULL_NET_COMMAND\n"
        "_f = pydevd.GetGlobalDebugger().cmd_factory\n"
        "def _silent(*args, **kwargs):\n"
        "    del _f.make_thread_suspend_message  # once: the class's method again\n"
        "    return NULL_NET_COMMAND\n"
        "if rank == 1:\n    _f.make_thread_suspend_message = _silent\n"
        "w = rank + 7\nprint('w', w)\n"
    )
    _debugger_on(dbg, cell, [{"line": 10}])
    msg_id = kernel.submit(cell)
    stops = dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    assert sorted(e["body"]["description"] for e in stops) == ["rank 0", "rank 1"], stops
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1] and {f["line"] for f in tops.values()} == {10}, tops
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "w 7" in text and "w 8" in text, text


def test_a_cell_on_a_dead_rank_says_it_died_and_the_debugger_does_not_wait_for_it(lab):
    # A dead rank answers no preparation: the debugger waited for it (10 s, then "could
    # not prepare rank 1 (no answer)") before the cell said that it died.
    kernel, dbg = lab
    cell = "%%on_all_ranks\nprint('alive', rank)"
    _debugger_on(dbg, cell, [{"line": 2}])
    victim = int(kernel.ok("import nbdist; print(nbdist.current_session().ranks[1].pid)").stdout)
    try:
        os.kill(victim, signal.SIGKILL)  # a rank nbdist started, by its PID
        assert wait_gone([victim]) == []
        # The session's own record of the death (its monitor reaps the rank).
        kernel.ok(
            "import time\n_s = nbdist.current_session()\n_t = time.monotonic() + 60\n"
            "while 1 not in _s.dead_ranks() and time.monotonic() < _t:\n    time.sleep(0.1)\n"
            "assert 1 in _s.dead_ranks()"
        )
        msg_id = kernel.submit(cell)
        dbg.cell_output(msg_id)
        reply = kernel.reply(msg_id)
        assert reply["status"] == "error" and "rank 1 died" in reply["evalue"], reply
        assert "could not prepare" not in _stderr(dbg, msg_id), _stderr(dbg, msg_id)
    finally:
        kernel.ok("%dist_restart", timeout=300)
    # The new rank 1 is debugged as before.
    msg_id = _stop_ranks_in(kernel, dbg, cell, 2)
    assert sorted(_stack(dbg)) == [0, 1]
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert "alive 0" in text and "alive 1" in text, text
