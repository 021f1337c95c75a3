#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest.
# The browser tier (tests/ui) needs Debian's chromium and Playwright: they are installed here
# (root or sudo) only when this run selects that tier, i.e. with no test paths (pytest then
# collects all of tests/, as CI's `bash scripts/test.sh` does) or with a path in or above
# tests/ui; a run of other tiers downloads no browser. Without chromium the UI tests are
# skipped, visibly.
#
# With no test paths (the whole suite, as CI runs it) the GPU-like tier runs after the rest;
# `bash scripts/test.sh --gpu-like [pytest args]` runs that tier alone: the CPU
# strategy tests whose code paths differ on GPUs (tensor, sequence, context and pipeline
# parallel, 2D/3D, autoplan, compare, staged point-to-point), with NBDIST_GPU_LIKE=1 on
# the ranks: optimizers forced to foreach kernels and point-to-point staged through host
# memory, as on GPU ranks (nbdist/engine/gpu_like.py). Test paths given replace the tier's.
#
# The whole suite runs on $NBDIST_TEST_WORKERS pytest-xdist workers (default 2; 1 runs it in
# one process): the tests spend much of their time waiting for processes to start and answer,
# so two workers on 2 cores take about two thirds of one's time. The tests marked `alone` (the
# browser tests, 256 ranks) then run in one process with nothing beside them. How the tests
# are shared out: tests/conftest.py.
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/test.sh [--gpu-like] [PYTEST ARGS...]

Creates .venv with nbdist[test] on first use, then runs pytest:
  bash scripts/test.sh                        every tier of tests/, then the GPU-like tier (as CI does)
  bash scripts/test.sh tests/unit -x          the paths and options given, nothing else
  bash scripts/test.sh --gpu-like             the GPU-like tier alone (NBDIST_GPU_LIKE=1 on the ranks)
The whole suite runs on NBDIST_TEST_WORKERS pytest-xdist workers (default 2; 1: one process).
Debian's chromium and Playwright are installed only when the run selects tests/ui.
Every other argument goes to pytest: .venv/bin/python -m pytest --help lists them.
USAGE
  exit 0
fi
workers="${NBDIST_TEST_WORKERS:-2}"
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
  echo "NBDIST_TEST_WORKERS=$workers: give a number of pytest workers, 1 or more (1: one process)" >&2
  exit 2
fi
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

# True when the arguments name a test path (a file, folder or node id) rather than options only.
has_test_paths() {
  local arg
  for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && return 0
  done
  return 1
}

# The GPU-like tier: 1 min 55 s of tests on 2 cores (CI at 518725c, 2026-12-01; 2 min 23 s while
# it still repeated three tests). Tests that set the GPU code paths up themselves run in the other
# tiers only: tests/dist/test_gpu_like.py and test_functional_gather.py set NBDIST_GPU_LIKE for
# each of their cases, test_p2p_staging.py installs the staging itself.
GPU_LIKE_TESTS=(
  tests/dist/test_strategies_sharded.py
  tests/dist/test_strategies_sequence.py
  tests/dist/test_strategies_mesh.py
  tests/dist/test_autoplan.py
  "tests/dist/test_strategies_misc.py::test_compare_every_strategy_trains_the_same_model"
  # One notebook: the pipeline's staged receive in a real kernel (the tier's time allows one).
  "tests/notebooks/test_examples.py::test_example_runs[12_pipeline_parallel]"
)
if [[ "${1:-}" == --gpu-like ]]; then
  shift
  export NBDIST_GPU_LIKE=1
  if has_test_paths "$@"; then
    exec "$PY" -m pytest -q -p no:cacheprovider "$@"
  fi
  exec "$PY" -m pytest -q -p no:cacheprovider "$@" "${GPU_LIKE_TESTS[@]}"
fi

if selects_ui "$@"; then
  bash scripts/install_browser.sh "$VENV" || echo "== chromium could not be installed: tests/ui will be skipped"
fi
if has_test_paths "$@"; then
  exec "$PY" -m pytest -q -p no:cacheprovider "$@"
fi
# The whole suite (what CI runs): every tier, then the GPU-like tier; fails if either fails.
parallel=()
((workers > 1)) && parallel=(-n "$workers" --dist loadscope)
status=0
if ((workers > 1)); then
  # The tests marked `alone` (tests/conftest.py: the browser tests, 256 ranks) after the rest.
  # A -m EXPR given here joins the split (pytest keeps only the last -m of a command line).
  mark="" rest=()
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      -m)
        if ((i + 1 >= ${#args[@]})); then
          echo "-m needs a marker expression after it, e.g. -m \"not slow\"" >&2
          exit 2
        fi
        mark="${args[i + 1]}" && i=$((i + 1))
        ;;
      -m?*) mark="${args[i]#-m}" ;;
      *) rest+=("${args[i]}") ;;
    esac
  done
  others="not alone" alone_tests="alone"
  if [[ -n "$mark" ]]; then
    others="($mark) and not alone" alone_tests="($mark) and alone"
  fi
  "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" -m "$others" "${rest[@]}" || status=$?
  [[ "$status" == 5 ]] && status=0 # 5: the filter selected only tests that run alone
  echo "== the tests that run alone (the browser tests, 256 ranks)"
  alone=0
  "$PY" -m pytest -q -p no:cacheprovider -m "$alone_tests" "${rest[@]}" || alone=$?
  if [[ "$alone" != 0 && "$alone" != 5 ]]; then # 5: a -k filter left nothing to run
    status=$alone
  fi
else
  "$PY" -m pytest -q -p no:cacheprovider "$@" || status=$?
fi
echo "== the GPU-like tier (NBDIST_GPU_LIKE=1): ${#GPU_LIKE_TESTS[@]} test paths"
tier=0
NBDIST_GPU_LIKE=1 "$PY" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@" "${GPU_LIKE_TESTS[@]}" || tier=$?
# 5: a -k or -m filter left the tier nothing to run, which is not a failure.
if [[ "$tier" != 0 && "$tier" != 5 ]]; then
  status=$tier
fi
exit "$status"
