#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite. Extra arguments go to pytest.
# The browser tests need Debian's chromium: installed here when missing (root or sudo);
# without it they are skipped, visibly.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
bash scripts/install_browser.sh "$VENV" || echo "== chromium could not be installed: tests/ui will be skipped"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
