"""pdb, input() and %dist_debug on the ranks, answered through Jupyter's stdin channel (a real kernel).

The kernel is started from the ``python3`` kernel spec with jupyter_client and
driven as a front end with stdin would drive it: cells are sent with
``allow_stdin=True`` and each ``input_request`` on the stdin channel is answered.
One kernel with two CPU ranks serves the whole module.
"""

from __future__ import annotations

import queue
import re
import time
from collections.abc import Callable

import pytest

from tests.notebooks.conftest import CELL_TIMEOUT, CellResult, Kernel, strip_ansi


@pytest.fixture(scope="module")
def kernel(dist_kernel):
    return dist_kernel


def run_with_stdin(
    kernel: Kernel,
    code: str,
    answer: Callable[[str, list[dict]], str | None],
    *,
    allow_stdin: bool = True,
    timeout: float = CELL_TIMEOUT,
) -> tuple[CellResult, list[str]]:
    """Execute ``code``; each input request is answered with ``answer(prompt, outputs so far)``.

    ``answer`` returning None leaves the request unanswered (the test acts itself).
    Returns the cell's result and the prompts in the order they came.
    """
    t0 = time.monotonic()
    msg_id = kernel.kc.execute(code, allow_stdin=allow_stdin)
    outputs: list[dict] = []
    prompts: list[str] = []
    deadline = time.monotonic() + timeout
    idle = False
    while not idle:
        assert time.monotonic() < deadline, f"no idle status within {timeout} s: {outputs!r}"
        try:
            req = kernel.kc.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            pass
        else:
            if req["msg_type"] == "input_request":
                prompt = req["content"]["prompt"]
                prompts.append(prompt)
                # Everything published before the request is there to read first.
                outputs += _iopub(kernel, msg_id, wait=0.3)
                value = answer(prompt, outputs)
                if value is not None:
                    kernel.kc.input(value)
        for msg in _iopub(kernel, msg_id, wait=0.02):
            if msg["msg_type"] == "status":
                idle = msg["content"]["execution_state"] == "idle"
            else:
                outputs.append(msg)
    reply = kernel.reply(msg_id, timeout)
    return CellResult(reply, outputs, time.monotonic() - t0), prompts


def _iopub(kernel: Kernel, msg_id: str, wait: float) -> list[dict]:
    """The iopub messages of ``msg_id`` that arrive within ``wait`` seconds (status included)."""
    found = []
    end = time.monotonic() + wait
    while True:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            return found
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] in ("stream", "display_data", "execute_result", "error", "status"):
            found.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return found


def _text(outputs: list[dict]) -> str:
    return strip_ansi("".join(m["content"].get("text", "") for m in outputs))


def _script(*answers: str):
    """An ``answer`` giving ``answers`` in turn."""
    remaining = list(answers)

    def answer(prompt: str, outputs: list[dict]) -> str:
        return remaining.pop(0)

    return answer


def _all_reduce_works(kernel: Kernel) -> None:
    kernel.ok("%%on_all_ranks\nt = torch.ones(1); dist.all_reduce(t); assert t.item() == 2")


BREAK_ON_RANK_1 = """%%on_all_ranks
x = rank * 10 + 3
if rank == 1:
    breakpoint()
t = torch.ones(1)
dist.all_reduce(t)
print('done', rank, x, t.item())
"""


def test_breakpoint_on_rank_1_p_shows_its_value_and_c_resumes(kernel):
    result, prompts = run_with_stdin(kernel, BREAK_ON_RANK_1, _script("p x", "c"))
    assert result.status == "ok", result.error_text()
    assert prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "]
    lines = _text(result.outputs).splitlines()
    assert "[rank 1] 13" in lines  # p x: rank 1's own value, not rank 0's 3
    assert "[rank 1] -> breakpoint()" in lines  # pdb's listing, streamed as rank 1's output
    assert "[rank 0] done 0 3 2.0" in lines and "[rank 1] done 1 13 2.0" in lines


def test_q_ends_the_cell_naming_the_rank(kernel):
    result, prompts = run_with_stdin(kernel, BREAK_ON_RANK_1, _script("q"))
    assert prompts == ["(Pdb rank 1) "]
    assert result.status == "error"
    assert result.reply["ename"] == "RankError"
    assert result.reply["evalue"].startswith("rank 1: BdbQuit: pdb was quit (q) on rank 1")
    _all_reduce_works(kernel)  # rank 0, released from its all_reduce, and the group are fine


def test_input_on_a_rank_is_labelled_and_answered(kernel):
    code = "%%on_all_ranks\nname = input('name? ') if rank == 1 else 'none'\nprint('hello', name)"
    result, prompts = run_with_stdin(kernel, code, _script("ada"))
    assert result.status == "ok", result.error_text()
    assert prompts == ["[rank 1] name? "]
    lines = _text(result.outputs).splitlines()
    assert "[rank 1] hello ada" in lines and "[rank 0] hello none" in lines


def test_two_ranks_stopping_at_once_are_served_in_turn(kernel):
    code = (
        "%%on_all_ranks\nmine = 100 + rank\nbreakpoint()\n"
        "t = torch.ones(1); dist.all_reduce(t); print('done', rank, t.item())"
    )
    asked: dict[str, int] = {}

    def answer(prompt: str, outputs: list[dict]) -> str:
        asked[prompt] = asked.get(prompt, 0) + 1
        return "p mine" if asked[prompt] == 1 else "c"

    result, prompts = run_with_stdin(kernel, code, answer)
    assert result.status == "ok", result.error_text()
    # Two prompts per rank, each labelled; the answers went to the rank that asked.
    assert sorted(prompts) == ["(Pdb rank 0) "] * 2 + ["(Pdb rank 1) "] * 2
    lines = _text(result.outputs).splitlines()
    assert "[rank 0] 100" in lines and "[rank 1] 101" in lines
    assert any(re.fullmatch(r"\[ranks? 0(-1)?\] done 0? ?.*2\.0", line) for line in lines)


def test_interrupt_at_the_prompt_ends_the_cell_on_every_rank(kernel):
    def interrupt(prompt: str, outputs: list[dict]) -> None:
        kernel.km.interrupt_kernel()
        return None

    result, prompts = run_with_stdin(kernel, BREAK_ON_RANK_1, interrupt)
    assert prompts == ["(Pdb rank 1) "]
    assert result.status == "error"
    assert "KeyboardInterrupt" in result.error_text()
    assert "done" not in _text(result.outputs)
    _all_reduce_works(kernel)


def test_without_stdin_the_cell_fails_at_once(kernel):
    code = "%%on_all_ranks\nif rank == 1:\n    breakpoint()\nprint('after', rank)"
    t0 = time.monotonic()
    result, prompts = run_with_stdin(kernel, code, _script(), allow_stdin=False)
    elapsed = time.monotonic() - t0
    assert prompts == []
    assert result.status == "error"
    assert result.reply["ename"] == "RankError"
    assert result.reply["evalue"].startswith("rank 1: NoStdinError: rank 1 asked for input")
    assert "this front end sends no input" in result.reply["evalue"]
    assert elapsed < 5, f"the no-stdin error took {elapsed:.1f} s"


def test_dist_debug_after_zero_division_on_rank_1(kernel):
    failed = kernel.execute(
        "%%on_all_ranks\ndef f(z):\n    return z / (rank - 1)\nf(rank * 10 + 7)"
    )
    assert failed.status == "error" and failed.reply["evalue"].startswith(
        "rank 1: ZeroDivisionError"
    )
    # Headless first: refused at once, and rank 1 keeps its error for a front end with stdin.
    for line in ("%dist_debug", "%dist_debug --rank 1"):
        headless, prompts = run_with_stdin(kernel, line, _script(), allow_stdin=False)
        assert (headless.status, prompts) == ("error", [])
        assert headless.reply["ename"] == "UsageError"
        assert "this front end sends no input" in headless.reply["evalue"]
    result, prompts = run_with_stdin(kernel, "%dist_debug", _script("p z", "q"))
    assert result.status == "ok", result.error_text()
    assert prompts == ["(Pdb rank 1) ", "(Pdb rank 1) "]
    text = _text(result.outputs)
    assert "[rank 1] post-mortem of rank 1: ZeroDivisionError: division by zero" in text
    assert "[rank 1] 17" in text.splitlines()  # p z: rank 1's local in the frame that raised
    _all_reduce_works(kernel)  # q left the ranks ready


def test_stdin_attached_follows_the_front_end(kernel):
    code = "from nbdist.driver.prompts import stdin_attached\nprint(stdin_attached())"
    with_stdin, _ = run_with_stdin(kernel, code, _script())
    headless, _ = run_with_stdin(kernel, code, _script(), allow_stdin=False)
    assert _text(with_stdin.outputs).strip() == "True"
    assert _text(headless.outputs).strip() == "False"


def test_a_cell_for_humans_is_skipped_headless(kernel):
    # The pattern docs/debugging.md gives for notebooks that must also run headless.
    code = (
        "from nbdist.driver.prompts import stdin_attached\n"
        "if stdin_attached():\n"
        "    %dist_debug\n"
        "else:\n"
        "    print('SKIPPED: %dist_debug needs a front end with stdin')"
    )
    result, prompts = run_with_stdin(kernel, code, _script(), allow_stdin=False)
    assert result.status == "ok", result.error_text()
    assert prompts == []
    assert _text(result.outputs) == "SKIPPED: %dist_debug needs a front end with stdin\n"
