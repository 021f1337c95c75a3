"""%dist_where from a kernel subshell while the notebook's cell hangs (a real Jupyter kernel).

JupyterLab's subshell console sends its cells to a subshell of the same
kernel (ipykernel >= 7), which runs them while the main shell is busy.
"""

from __future__ import annotations

import queue
import time

import pytest

from tests.notebooks.conftest import Kernel, strip_ansi


def _control(kernel: Kernel, msg_type: str, content: dict) -> dict:
    msg = kernel.kc.session.msg(msg_type, content)
    kernel.kc.control_channel.send(msg)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            reply = kernel.kc.get_control_msg(timeout=1.0)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            return reply["content"]
    raise TimeoutError(f"no reply to {msg_type}")


def _execute_in_subshell(kernel: Kernel, subshell_id: str, code: str) -> str:
    msg = kernel.kc.session.msg(
        "execute_request",
        {"code": code, "silent": False, "store_history": False, "allow_stdin": False},
    )
    msg["header"]["subshell_id"] = subshell_id
    kernel.kc.shell_channel.send(msg)
    outputs, _ = kernel.collect(msg["header"]["msg_id"], timeout=60)
    return strip_ansi("".join(o["content"].get("text", "") for o in outputs))


def test_dist_where_in_a_subshell_while_the_cell_hangs():
    kernel = Kernel()
    try:
        features = kernel.kc.kernel_info(reply=True)["content"].get("supported_features", [])
        if "kernel subshells" not in features:
            pytest.skip("this ipykernel has no subshells")
        kernel.start_dist(2)
        hung = kernel.submit(
            "%%on_all_ranks\nimport time\nif rank == 1:\n    time.sleep(60)\n"
            "dist.all_reduce(torch.ones(1))"
        )
        subshell = _control(kernel, "create_subshell_request", {})["subshell_id"]
        text = ""
        for _ in range(60):
            text = _execute_in_subshell(kernel, subshell, "%dist_where")
            if "rank 0: inside all_reduce" in text and "time.sleep(60)" in text:
                break
            time.sleep(0.5)
        assert "rank 0: inside all_reduce #1 for " in text
        assert "rank 1: never entered all_reduce #1 (last: none yet)" in text
        kernel.km.interrupt_kernel()
        outputs, _ = kernel.collect(hung, timeout=60)
        assert kernel.reply(hung)["status"] == "error"
        kernel.ok("%%on_all_ranks\nt = torch.ones(1); dist.all_reduce(t); assert t.item() == 2")
        kernel.ok("%dist_stop")
    finally:
        kernel.shutdown()
