#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite. Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ROOT"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
