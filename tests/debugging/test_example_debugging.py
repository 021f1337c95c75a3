"""examples/24_debugging.ipynb as a user at JupyterLab runs it: every pdb prompt answered.

tests/notebooks runs the notebook headless (no stdin: its pdb cells print SKIPPED).
Here each code cell goes to a real kernel with ``allow_stdin=True``, and the
prompts are answered as the notebook's text tells the reader to: ``p z`` then
``q`` at the post-mortem, ``p x`` then ``c`` at the breakpoint. Rank 1's values
must show (z = 1, x = 13), and every cell must succeed.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from tests.debugging.test_pdb_on_ranks import run_with_stdin
from tests.notebooks.conftest import Kernel, strip_ansi

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "24_debugging.ipynb"


def _text(result) -> str:
    return strip_ansi(
        "".join(
            m["content"].get("text", "") + str(m["content"].get("data", {}).get("text/plain", ""))
            for m in result.outputs
        )
    )


def test_the_debugging_notebook_with_stdin_answered():
    cells = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    replies = {"post-mortem": iter(["p z", "q"]), "breakpoint": iter(["p x", "c"])}
    prompts_seen: dict[str, list[str]] = {"post-mortem": [], "breakpoint": []}
    texts = []
    kernel = Kernel()
    try:
        for source in cells:
            which = "post-mortem" if "%dist_debug" in source else "breakpoint"

            def answer(prompt, outputs, which=which):
                prompts_seen[which].append(prompt)
                return next(replies[which])

            result, _ = run_with_stdin(kernel, source, answer)
            assert result.status == "ok", (source, _text(result))
            texts.append(_text(result))
    finally:
        kernel.shutdown()
    everything = "\n".join(texts)
    assert "SKIPPED" not in everything  # with stdin, the waiting cells really ran
    assert prompts_seen["post-mortem"] == ["(Pdb rank 1) "] * 2, prompts_seen
    assert prompts_seen["breakpoint"] == ["(Pdb rank 1) "] * 2, prompts_seen
    assert "[rank 1] 1" in everything  # p z at the post-mortem: rank 1's z
    assert "[rank 1] 13" in everything  # p x at the breakpoint: rank 1's x
    assert "sum of x over the ranks: 16.0" in everything
