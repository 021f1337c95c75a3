"""Execute a notebook in a fresh kernel and print its outputs (used by scripts/quickstart.sh)."""

from __future__ import annotations

import os
import sys

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    if output.output_type == "error":
        return "\n".join(output.traceback) + "\n"
    data = output.get("data", {})
    return data.get("text/plain", "") + "\n" if data else ""


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": os.path.dirname(path) or "."}},
    )
    failed = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = exc
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        print(">>> " + cell.source.replace("\n", "\n... "))
        for output in cell.get("outputs", []):
            sys.stdout.write(_text(output))
    os.makedirs("artifacts", exist_ok=True)
    out = os.path.join("artifacts", os.path.basename(path))
    nbformat.write(nb, out)
    print(f"\nexecuted notebook written to {out}")
    if failed is not None:
        # One line that says which cell failed and why: what a log's tail shows.
        where = next(
            (
                (i, cell)
                for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code")
                if any(o.output_type == "error" for o in cell.get("outputs", []))
            ),
            None,
        )
        cell_text = (
            f"code cell {where[0]} ({where[1].source.splitlines()[:2]})" if where else "a cell"
        )
        reason = f"{getattr(failed, 'ename', type(failed).__name__)}: {getattr(failed, 'evalue', failed)}"
        print(f"FAILED: {cell_text} raised {reason[:1500]}", file=sys.stderr)
        return 1
    print("OK: every cell ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "examples/00_quickstart.ipynb"))
