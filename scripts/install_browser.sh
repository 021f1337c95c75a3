#!/usr/bin/env bash
# Install what the browser test (tests/ui/) needs; safe to run again (skips what is there).
#   - Debian's chromium at /usr/bin/chromium (apt-get update + install; root or sudo), if missing;
#   - pip packages playwright and jupyterlab into a venv: the one given as $1, else the
#     project's .venv (made by scripts/_env.sh, the same set-up scripts/test.sh uses).
# Playwright drives the system chromium (executable_path=/usr/bin/chromium): this script never
# downloads a Playwright browser (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1, no `playwright install`).
set -euo pipefail
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1

if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/install_browser.sh [VENV]

Installs what tests/ui needs, skipping what is there: Debian's chromium at
/usr/bin/chromium (apt-get; root or sudo), then playwright and jupyterlab into VENV
(default: the project's .venv, created with nbdist[test] if missing). Playwright
drives the system chromium: no Playwright browser is downloaded.
USAGE
  exit 0
fi
if [[ $# -gt 1 ]]; then
  echo "scripts/install_browser.sh: takes one venv directory, got: $*; see --help" >&2
  exit 2
fi
if [[ $# -eq 1 ]]; then
  if [[ ! -d "$1" ]]; then
    echo "scripts/install_browser.sh: '$1' is not a directory: give a venv (e.g. .venv); see --help" >&2
    exit 2
  fi
  VENV="$(cd "$1" && pwd)"
  PY="$VENV/bin/python"
  if [[ ! -x "$PY" ]]; then
    echo "scripts/install_browser.sh: no Python at $PY: '$1' is not a venv (python3 -m venv $1 makes one)" >&2
    exit 1
  fi
else
  # Creates .venv with nbdist[test] on first use (no-op when up to date); sets VENV and PY.
  source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
fi

if [[ -x /usr/bin/chromium ]]; then
  echo "== /usr/bin/chromium present"
else
  echo "== installing Debian chromium (apt-get)"
  SUDO=""
  if [[ "$(id -u)" != 0 ]]; then
    SUDO="sudo"
  fi
  $SUDO apt-get update
  $SUDO env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y --no-install-recommends chromium fonts-dejavu-core
  if [[ ! -x /usr/bin/chromium ]]; then
    echo "error: apt-get installed chromium but /usr/bin/chromium is missing" >&2
    exit 1
  fi
fi

if "$PY" -c "import playwright, jupyterlab" 2>/dev/null; then
  echo "== playwright and jupyterlab already in $VENV"
else
  echo "== installing playwright and jupyterlab into $VENV"
  "$PY" -m pip install --quiet "playwright>=1.40" "jupyterlab>=4.2,<5"
fi
