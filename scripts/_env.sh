# Sourced by scripts/quickstart.sh and scripts/test.sh: make .venv with nbdist installed.
# torch==2.13.0 goes first: on machines that carry its CPU wheel locally this avoids
# pulling a multi-GB CUDA build; elsewhere pip fetches that version normally.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NBDIST_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.nbdist-installed"
if [[ ! -x "$PY" ]]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_env.sh" | sha256sum | cut -c1-16)"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  if ! command -v node >/dev/null; then
    # Building nbdist's JupyterLab extension (labextension/) needs node; jlpm comes with jupyterlab.
    echo "== installing Debian nodejs (needed to build the JupyterLab extension)"
    SUDO=""; [[ "$(id -u)" != 0 ]] && SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs
  fi
  echo "== installing torch==2.13.0 and nbdist[test] into $VENV"
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet "torch==2.13.0"
  "$PY" -m pip install --quiet -e "$ROOT[test]"
  echo "$want" > "$STAMP"
fi
# nbdist is installed editable: byte-compile it, so ranks and kernels do not compile its
# modules on every start where PYTHONDONTWRITEBYTECODE is set (~20 ms per process here).
"$PY" -m compileall -q "$ROOT/nbdist" >/dev/null || true
export PATH="$VENV/bin:$PATH"
