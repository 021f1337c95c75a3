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
        print(f"FAILED: {str(failed).splitlines()[0] if str(failed) else failed}", file=sys.stderr)
        return 1
    print("OK: every cell ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "examples/00_quickstart.ipynb"))
