"""Execute a notebook in a fresh kernel and print its outputs (used by scripts/quickstart.sh).

Runs as its own process on the machine that runs the notebook; the notebook's kernel is
another process, started and shut down here.
"""

from __future__ import annotations

import argparse
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


# A kernel that dies before its first reply is started again, this many times in all: the
# ports of a new kernel are chosen free, released, and bound by the kernel a moment later,
# so with many kernels starting at once (scripts/gpu_check.sh) another process can take one
# in between and the kernel exits with "Address already in use" (its stderr, in this log).
KERNEL_STARTS = 3


def _died_at_start(exc: Exception, started: list[int]) -> bool:
    return not started and "Kernel died before replying to kernel_info" in str(exc)


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    started: list[int] = []  # the index (among all cells) of each cell as it starts
    failed = None
    for attempt in range(1, KERNEL_STARTS + 1):
        client = NotebookClient(
            nb,
            timeout=900,
            # nbclient's default is 60 s; a machine running many notebooks and test files
            # side by side (scripts/gpu_check.sh) has taken longer to answer a new kernel's
            # first request.
            startup_timeout=180,
            kernel_name="python3",
            resources={"metadata": {"path": os.path.dirname(path) or "."}},
            on_cell_start=lambda cell, cell_index: started.append(cell_index),
        )
        try:
            client.execute()
            failed = None
        except CellExecutionError as exc:
            failed = exc
        except Exception as exc:  # the kernel did not start or died, or a cell ran past its time
            failed = exc
        if failed is None or not _died_at_start(failed, started) or attempt == KERNEL_STARTS:
            break
        print(
            f"the kernel died before its first reply (start {attempt} of {KERNEL_STARTS}; "
            "its own error is above): starting another",
            file=sys.stderr,
            flush=True,
        )
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
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        where = next(
            (
                i
                for i in code
                if any(o.output_type == "error" for o in nb.cells[i].get("outputs", []))
            ),
            # No error output: the cell that was running when the kernel died or time ran out.
            started[-1] if started and not isinstance(failed, CellExecutionError) else None,
        )
        if where is not None:
            cell_text = f"code cell {code.index(where)} ({nb.cells[where].source.splitlines()[:2]})"
        elif not started:
            cell_text = "the kernel, before the first cell,"
        else:
            cell_text = "a cell"
        reason = f"{getattr(failed, 'ename', type(failed).__name__)}: {getattr(failed, 'evalue', failed)}"
        print(f"FAILED: {cell_text} raised {reason[:1500]}", file=sys.stderr)
        return 1
    print("OK: every cell ran")
    return 0


def _parse(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(
        prog="run_notebook.py",
        description="Execute a notebook in a fresh kernel, print each cell's outputs, write the "
        "executed copy to artifacts/ and end with 'OK: every cell ran' (exit 0) or a "
        "'FAILED:' line naming the cell and the exception (exit 1).",
    )
    parser.add_argument(
        "notebook",
        nargs="?",
        default="examples/00_quickstart.ipynb",
        help="path of the .ipynb to run (default: examples/00_quickstart.ipynb)",
    )
    path = parser.parse_args(argv).notebook
    if not os.path.isfile(path):
        parser.error(
            f"no notebook at {path!r}: give the path of an .ipynb file, e.g. examples/00_quickstart.ipynb"
        )
    return path


if __name__ == "__main__":
    sys.exit(main(_parse(sys.argv[1:])))
