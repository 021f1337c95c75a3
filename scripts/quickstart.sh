#!/usr/bin/env bash
# Set up (first run only) and execute examples/00_quickstart.ipynb headlessly,
# printing each cell's output; the executed copy goes to artifacts/.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/quickstart.sh [NOTEBOOK]

Creates .venv with nbdist on first use (about 4 minutes), then runs NOTEBOOK
(default examples/00_quickstart.ipynb) in a fresh kernel: each cell's output is
printed, the executed copy written to artifacts/, and the last line says
"OK: every cell ran" (exit 0) or "FAILED: ..." with the cell and the exception.
USAGE
  exit 0
fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
  echo "scripts/quickstart.sh: takes one notebook path, got: $*; see bash scripts/quickstart.sh --help" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec "$PY" scripts/run_notebook.py "${1:-examples/00_quickstart.ipynb}"
