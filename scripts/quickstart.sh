#!/usr/bin/env bash
# Set up (first run only) and execute examples/00_quickstart.ipynb headlessly,
# printing each cell's output; the executed copy goes to artifacts/.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec "$PY" scripts/run_notebook.py "${1:-examples/00_quickstart.ipynb}"
