#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest.
# The browser tier (tests/ui) needs Debian's chromium and Playwright: they are installed here
# (root or sudo) only when this run selects that tier, i.e. with no test paths (pytest then
# collects all of tests/, as CI's `bash scripts/test.sh` does) or with a path in or above
# tests/ui; a run of other tiers downloads no browser. Without chromium the UI tests are
# skipped, visibly.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"

# True when the pytest arguments select tests/ui: no test path at all, or a path (a folder
# or a .py file, "::test" allowed) inside tests/ui or one that contains it (tests/, .).
selects_ui() {
  local ui="$ROOT/tests/ui" arg path abs paths=0
  for arg in "$@"; do
    [[ "$arg" == -* ]] && continue # an option (its value, if any, is not a test path)
    path="${arg%%::*}"
    [[ -d "$path" || ( -f "$path" && "$path" == *.py ) ]] || continue
    paths=1
    abs="$(cd "$(dirname "$path")" && pwd)/$(basename "$path")"
    abs="${abs%/.}"
    if [[ "$abs" == "$ui" || "$abs" == "$ui/"* || "$ui/" == "$abs/"* ]]; then
      return 0
    fi
  done
  ((paths == 0))
}

if selects_ui "$@"; then
  bash scripts/install_browser.sh "$VENV" || echo "== chromium could not be installed: tests/ui will be skipped"
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
