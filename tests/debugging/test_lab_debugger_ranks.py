"""JupyterLab's debugger on the ranks, one rank at a time: a real kernel, 2 CPU ranks.

Continue acts on the rank whose frame is selected while the other stays paused
(and waits in the collective that follows), the Callstack's summary frame acts
on every stopped rank, tensors show their shape, dtype, device and small values
in the Variables panel, and ``%dist_stop``/``%dist_restart`` while ranks are
paused in the debugger end them, leave no process behind, and the debugger sees
the ranks go.
"""

from __future__ import annotations

import time

import pytest

from nbdist.driver.lab_debugger import RANKS_THREAD, SUMMARY_PREFIX
from tests.conftest import wait_gone
from tests.debugging.test_lab_debugger import (
    LabDebugClient,
    _debugger_on,
    _select_all,
    _stack,
    _stop_ranks_in,
)
from tests.notebooks.conftest import Kernel


def _summary(dbg: LabDebugClient) -> dict:
    frames = dbg.request("stackTrace", threadId=RANKS_THREAD)["body"]["stackFrames"]
    assert frames[0]["name"].startswith(SUMMARY_PREFIX), frames
    return frames[0]


def _variables(dbg: LabDebugClient, frame_id: int) -> dict[str, dict]:
    found: dict[str, dict] = {}
    for scope in dbg.request("scopes", frameId=frame_id)["body"]["scopes"]:
        body = dbg.request("variables", variablesReference=scope["variablesReference"])["body"]
        for var in body["variables"]:
            found.setdefault(var["name"], var)
    return found


def _idle(dbg: LabDebugClient, msg_id: str) -> bool:
    dbg._drain()
    return any(
        m["parent_header"].get("msg_id") == msg_id
        and m["msg_type"] == "status"
        and m["content"]["execution_state"] == "idle"
        for m in dbg.other
    )


COLLECTIVE = (
    "%%on_all_ranks\n"
    "import torch, torch.distributed as dist\n"
    "v = rank + 1\n"
    "t = torch.tensor([float(v)])\n"
    "dist.all_reduce(t)\n"
    "print('sum', rank, t.item())"
)


def test_continue_one_rank_while_the_other_stays_paused(lab):
    kernel, dbg = lab
    _debugger_on(dbg, COLLECTIVE, [{"line": 4}])
    msg_id = kernel.submit(COLLECTIVE)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)

    # The summary frame comes first; an evaluate there runs on every stopped rank.
    summary = _summary(dbg)
    assert "ranks 0-1" in summary["name"] and summary["line"] == 4, summary
    result = dbg.request("evaluate", expression="v", frameId=summary["id"], context="repl")
    assert result["body"]["result"] == "rank 0: 1\nrank 1: 2", result
    same = dbg.request("evaluate", expression="v * 0", frameId=summary["id"], context="repl")
    assert same["body"]["result"] == "ranks 0-1: 0", same

    # Select rank 1's frame, Continue (JupyterLab's form: thread 1 once it dropped the
    # stopped thread): rank 1 runs on into the all_reduce, rank 0 stays paused.
    tops = _stack(dbg)
    dbg.request("scopes", frameId=tops[1]["id"])
    # JupyterLab lists the frames again on each rank's stop event, and one may come after
    # the click: the same frames keep their ids, so rank 1's frame stays the one selected.
    assert _stack(dbg) == tops
    dbg.events.clear()
    assert dbg.request("continue", threadId=1)["success"]
    again = dbg.wait_event("stopped", threadId=RANKS_THREAD, timeout=60)[0]["body"]
    assert again["description"] == "rank 0 still stopped", again
    assert sorted(_stack(dbg)) == [0], "rank 0 is still shown stopped, rank 1 is not"
    time.sleep(2)  # rank 1 waits in the collective for rank 0: the cell does not end
    assert not _idle(dbg, msg_id)
    assert "sum 1" not in "".join(m["content"].get("text", "") for m in dbg.other)

    # Continue with the summary frame selected (as JupyterLab selects it after a stop).
    summary = _summary(dbg)
    dbg.request("scopes", frameId=summary["id"])
    assert dbg.request("continue", threadId=1)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "sum 0 3.0" in text and "sum 1 3.0" in text, text
    assert RANKS_THREAD not in [t["id"] for t in dbg.request("threads")["body"]["threads"]]


TENSORS = (
    "%%on_all_ranks\n"
    "import torch\n"
    "small = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank\n"
    "big = torch.zeros(300, 400, dtype=torch.float16)\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.tensor import Shard, distribute_tensor\n"
    "sharded = distribute_tensor(torch.arange(4.0), init_device_mesh('cpu', (2,)), [Shard(0)])\n"
    "done = True"
)


def test_tensor_variables_show_shape_dtype_device_and_small_values(lab):
    kernel, dbg = lab
    dbg.events.clear()
    _debugger_on(dbg, TENSORS, [{"line": 8}])
    msg_id = kernel.submit(TENSORS)
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    tops = _stack(dbg)
    variables = _variables(dbg, tops[1]["id"])
    small = variables["small"]["value"]
    assert "(2, 3)" in small and "float32" in small and "cpu" in small, small
    assert "[[1., 2., 3.]" in small and "[4., 5., 6.]]" in small, small
    big = variables["big"]["value"]
    assert "(300, 400)" in big and "float16" in big and "cpu" in big, big
    assert "0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0." not in big, big
    # A DTensor: its global shape, placements and this rank's shard (no collective).
    sharded = variables["sharded"]["value"]
    assert "(4,)" in sharded and "Shard(dim=0)" in sharded, sharded
    assert "local shard [2., 3.]" in sharded, sharded
    # Expanded, a tensor lists its shape, dtype and device, and the values of a small one.
    reference = variables["small"]["variablesReference"]
    assert reference, variables["small"]
    children = {
        v["name"]: v["value"]
        for v in dbg.request("variables", variablesReference=reference)["body"]["variables"]
    }
    assert children["shape"] == "(2, 3)" and children["dtype"] == "torch.float32", children
    assert "cpu" in children["device"], children
    assert "[4.0, 5.0, 6.0]" in children["values"], children
    # The Evaluate box shows the same.
    shown = dbg.request("evaluate", expression="small", frameId=tops[0]["id"], context="repl")
    assert "(2, 3)" in shown["body"]["result"] and "[[0., 1., 2.]" in shown["body"]["result"]
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"


def test_next_with_the_summary_frame_selected_steps_every_rank(lab):
    kernel, dbg = lab
    cell = "%%on_all_ranks\na = rank\nb = a + 1\nprint('b', b)"
    msg_id = _stop_ranks_in(kernel, dbg, cell, 2)
    dbg.request("scopes", frameId=_summary(dbg)["id"])
    dbg.events.clear()
    assert dbg.request("next", threadId=RANKS_THREAD)["success"]
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=60)
    tops = _stack(dbg)
    assert {r: f["line"] for r, f in tops.items()} == {0: 3, 1: 3}, tops
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "b 1" in text and "b 2" in text, text


def test_next_with_a_ranks_frame_selected_steps_that_rank_alone(lab):
    kernel, dbg = lab
    cell = "%%on_all_ranks\na = rank\nb = a + 1\nc = b + 1\nprint('c', c)"
    msg_id = _stop_ranks_in(kernel, dbg, cell, 2)
    tops = _stack(dbg)
    dbg.request("scopes", frameId=tops[1]["id"])
    dbg.events.clear()
    assert dbg.request("next", threadId=RANKS_THREAD)["success"]
    dbg.wait_event("stopped", threadId=RANKS_THREAD, timeout=60)
    after = _stack(dbg)
    assert {r: f["line"] for r, f in after.items()} == {0: 2, 1: 3}, after
    assert after[0]["id"] == tops[0]["id"]  # the rank that stayed keeps its frame's id
    # debugpy gives a stepped frame a new id: JupyterLab then selects the summary frame,
    # and the next step is every stopped rank's.
    _select_all(dbg)
    dbg.events.clear()
    assert dbg.request("next", threadId=RANKS_THREAD)["success"]
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=60)
    assert {r: f["line"] for r, f in _stack(dbg).items()} == {0: 3, 1: 4}
    _select_all(dbg)
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "c 2" in text and "c 3" in text, text


def _rank_pids(kernel: Kernel, *, session: bool) -> list[int]:
    """The ranks' processes and any they started (debugpy runs inside the rank: no
    adapter process); with ``session``, every process the session started
    (controller, launcher...) too."""
    out = kernel.ok(
        "%%on_all_ranks\nimport os, psutil\n"
        "print('pids', os.getpid(), *[c.pid for c in psutil.Process().children(recursive=True)])"
    ).stdout
    pids = [
        int(p) for line in out.splitlines() if "pids" in line for p in line.split("pids")[1].split()
    ]
    assert len(pids) == 2, f"the ranks started processes of their own: {out}"
    return sorted(set(pids) | set(kernel.nbdist_pids() if session else ()))


def _run(kernel: Kernel, dbg: LabDebugClient, code: str) -> str:
    """Run ``code`` in the kernel and insist it succeeded; its output (read by ``dbg``,
    which keeps the debug events that arrive meanwhile)."""
    msg_id = kernel.submit(code)
    text = dbg.cell_output(msg_id, timeout=240)
    reply = kernel.reply(msg_id)
    assert reply["status"] == "ok", (code, reply, text)
    return text


@pytest.mark.parametrize("magic", ["%dist_stop", "%dist_restart"])
def test_stop_or_restart_while_ranks_are_paused(lab, magic):
    kernel, dbg = lab
    dbg.events.clear()
    cell = "%%on_all_ranks --noblock\nw = rank\nprint('ran', w)"
    _debugger_on(dbg, cell, [{"line": 2}])
    # %dist_restart keeps the controller: the ranks must go.
    pids = _rank_pids(kernel, session=magic == "%dist_stop")
    _run(kernel, dbg, cell)  # --noblock: the kernel is free while the ranks are paused
    dbg.wait_event("stopped", threadId=RANKS_THREAD, count=2, timeout=120)
    # Still paused, and shown so, after the kernel's cell returned: the "continued"
    # waited for below is the ranks going, not the --noblock cell's end.
    time.sleep(1.5)
    dbg._drain()
    assert not [e for e in dbg.events if e.get("event") == "continued"], dbg.events
    # Once in a full run of the tests on 2 workers rank 1 was missing here: it reached its
    # breakpoint while rank 0, the one rank shown stopped when the kernel's cell returned,
    # said it was paused, and the cell's end then cleared every rank not said paused. Only
    # the ranks asked are cleared now. (The stops' words and the frames say who stopped.)
    stops = [e["body"].get("description") for e in dbg.events if e.get("event") == "stopped"]
    tops = _stack(dbg)
    assert sorted(tops) == [0, 1], (stops, tops)

    said = _run(kernel, dbg, magic)
    # The debugger sees the ranks go: no thread of stopped ranks any more.
    dbg.wait_event("continued", threadId=RANKS_THREAD, timeout=60)
    assert RANKS_THREAD not in [t["id"] for t in dbg.request("threads")["body"]["threads"]]
    assert wait_gone(pids, timeout=60) == [], f"left behind after {magic}: {said}"

    if magic == "%dist_stop":
        kernel.start_dist(2)
    # The new ranks are debugged as the old ones were.
    cell = "%%on_all_ranks\nw = rank\nprint('ran', w)"
    msg_id = _stop_ranks_in(kernel, dbg, cell, 2)
    assert sorted(_stack(dbg)) == [0, 1]
    assert dbg.request("continue", threadId=RANKS_THREAD)["success"]
    text = dbg.cell_output(msg_id)
    assert kernel.reply(msg_id)["status"] == "ok"
    assert "ran 0" in text and "ran 1" in text, text
