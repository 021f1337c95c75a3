#!/usr/bin/env bash
# Runs on a GPU server with no package index: a Python (3.12 by default) that already
# has a CUDA build of torch, this checkout, and a wheelhouse made elsewhere by
# scripts/wheelhouse.sh. It makes a throw-away venv on top of the system site-packages
# (the server's torch is used, never reinstalled), installs nbdist and the test tools
# offline from the wheelhouse, then runs, side by side where the cores allow (each job
# under its own time limit, all within a time budget; scripts/gpu_check_steps.py):
#   pytest tests/gpu (one process per test file and layout) · every examples/*.ipynb
#   (scripts/run_notebook.py) · then, alone: bench/nccl.py --quick --settle 2 · bench/train.py
#   --windows 9 · bench/log_call.py --cuda --flushes (bench/shared_gpu.py and
#   bench/log_cost.py --profile when asked)
# It goes on past a failing job, keeps every log under the output directory and ends
# with a markdown results block (device, date, commit, versions, each job's result, and
# for a failure its cell or tests, exception and last lines) for bench/RESULTS.md, and
# results.json, from which --only-failed re-runs what did not pass. Exit status: 0 only
# if no job failed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STARTED="$(date -u '+%Y-%m-%d %H:%M UTC')"

usage() {
  cat <<'EOF'
usage: bash scripts/gpu_check.sh WHEELHOUSE [OUTDIR] [options]

On a GPU server without internet: install nbdist from WHEELHOUSE (made by
scripts/wheelhouse.sh) into a venv over the system Python's CUDA torch, run
tests/gpu and every example notebook side by side, then bench/nccl.py --quick
--settle 2 (90 s at most), bench/train.py --windows 9 and bench/log_call.py
--cuda --flushes alone (and bench/shared_gpu.py with --steps ...,shared,
bench/log_cost.py --profile with --steps ...,logcost), within a time budget, and
print a results block for bench/RESULTS.md. Exit status 0 only if every job passed.
The nbdist wheel in WHEELHOUSE must be built from this checkout: its nbdist/ files
are compared with the checkout's, and a wheel from other sources is refused.

OUTDIR (logs, executed notebooks, results.md, results.json): the argument, else
$NBDIST_GPU_CHECK_OUT, else $OUT if set, else ./gpu_check_out.

options:
  --steps LIST    comma-separated subset of: tests,notebooks,nccl,train,shared,log,logcost
                  (default: tests,notebooks,nccl,train,log; shared is bench/shared_gpu.py,
                  logcost bench/log_cost.py --profile)
  --timeout S     time limit of each job in seconds (default: a pytest shard 540, a
                  notebook 420, a benchmark 240)
  --budget S      start no job that would not end within S seconds of the first
                  (default 540: with install and start-up the check fits 10 minutes)
  --slots N       ranks (plus one per kernel or pytest) running at once (default: cores)
  --examples GLOB only the notebooks examples/GLOB.ipynb (default: every one, [0-9][0-9]_*);
                  several, comma-separated: --examples '02_*,09_*,1[12]_*'
  --only-failed   only the jobs that did not pass in the previous results.json (a
                  pytest shard narrowed to its failed tests)
  --since COMMIT  those, plus the jobs whose own files (a notebook, a GPU test file,
                  a benchmark) changed since COMMIT
  --previous FILE the earlier results.json (default: OUTDIR/results.json)
  --pack          on exit (after a failure or an interrupt too), put logs/, notebooks/
                  and the pytest XML files into one OUTDIR/logs.tar.gz (for copying the
                  results off a machine that hands back few files); results.md,
                  results.json and gpu_check.log stay as they are
  --dry-run       list the jobs that would run, with their commands, and stop
                  (no wheelhouse, venv or GPU needed; a WHEELHOUSE given is checked
                  against this checkout, as a run would)
  --venv DIR      make (or reuse) the venv in DIR and keep it; default: a temporary
                  venv, removed at the end
  --allow-cpu     go on without CUDA (to try the script itself on a CPU machine)
  -h, --help      this help

environment: PYTHON (default python3.12 if it runs, else python3), NBDIST_COMMIT
(the commit to report when the checkout has no .git).
EOF
}

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

WH="" OUTDIR="" STEPS="tests,notebooks,nccl,train,log" LIMIT="" VENV_ARG="" ALLOW_CPU=0
EXAMPLES='[0-9][0-9]_*' BUDGET=540 SLOTS="" ONLY_FAILED=0 SINCE="" PREVIOUS="" DRY_RUN=0 PACK=0
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --steps) (($# >= 2)) || die "--steps needs a list"; STEPS="$2"; shift 2 ;;
    --timeout) (($# >= 2)) || die "--timeout needs seconds"; LIMIT="$2"; shift 2 ;;
    --examples) (($# >= 2)) || die "--examples needs a pattern"; EXAMPLES="$2"; shift 2 ;;
    --venv) (($# >= 2)) || die "--venv needs a directory"; VENV_ARG="$2"; shift 2 ;;
    --allow-cpu) ALLOW_CPU=1; shift ;;
    --budget) (($# >= 2)) || die "--budget needs seconds"; BUDGET="$2"; shift 2 ;;
    --slots) (($# >= 2)) || die "--slots needs a number"; SLOTS="$2"; shift 2 ;;
    --only-failed) ONLY_FAILED=1; shift ;;
    --since) (($# >= 2)) || die "--since needs a commit"; SINCE="$2"; shift 2 ;;
    --previous) (($# >= 2)) || die "--previous needs a results.json"; PREVIOUS="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --pack) PACK=1; shift ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *)
      if [[ -z "$WH" ]]; then WH="$1"
      elif [[ -z "$OUTDIR" ]]; then OUTDIR="$1"
      else die "unexpected argument '$1' (see --help)"; fi
      shift ;;
  esac
done
NBDIST_WHL=""
# --dry-run needs no wheelhouse; given one, it is checked as a run would (here, before a
# GPU machine's time is spent on a stale one).
if ((DRY_RUN == 0)) || [[ -n "$WH" ]]; then
  [[ -n "$WH" ]] || { usage >&2; die "missing WHEELHOUSE"; }
  [[ -d "$WH" ]] || die "wheelhouse '$WH' is not a directory (make one with scripts/wheelhouse.sh)"
  WH="$(cd "$WH" && pwd)"
  for w in "$WH"/nbdist-*.whl; do [[ -f "$w" ]] && NBDIST_WHL="$w"; done
  [[ -n "$NBDIST_WHL" ]] || die "no nbdist-*.whl in '$WH' (make the wheelhouse with scripts/wheelhouse.sh)"
fi
if [[ -n "$LIMIT" && ! "$LIMIT" =~ ^[1-9][0-9]*$ ]]; then die "--timeout '$LIMIT': seconds, a positive integer"; fi
[[ "$BUDGET" =~ ^[1-9][0-9]*$ ]] || die "--budget '$BUDGET': seconds, a positive integer"
[[ -z "$SLOTS" || "$SLOTS" =~ ^[1-9][0-9]*$ ]] || die "--slots '$SLOTS': a positive integer"
IFS=',' read -r -a STEP_LIST <<<"$STEPS"
for s in "${STEP_LIST[@]}"; do
  [[ "$s" =~ ^(tests|notebooks|nccl|train|shared|log|logcost)$ ]] ||
    die "--steps: unknown step '$s' (tests,notebooks,nccl,train,shared,log,logcost)"
done
if [[ -n "$SINCE" ]]; then
  git -C "$ROOT" rev-parse --verify --quiet "$SINCE^{commit}" >/dev/null ||
    die "--since '$SINCE': not a commit of this checkout"
fi
command -v timeout >/dev/null || die "needs 'timeout' (coreutils)"

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
# Runs, not only found: a version manager's shim can be on PATH for a version it does not activate.
elif python3.12 -c '' >/dev/null 2>&1; then PY="python3.12"
else PY="python3"; fi
command -v "$PY" >/dev/null || die "no '$PY' here (set PYTHON=/path/to/python)"

# The jobs' planner and runner; the same arguments for --dry-run and the real run.
steps_args() {
  local out="$1"
  STEP_ARGS=(--root "$ROOT" --out "$out" --steps "$STEPS" --examples "$EXAMPLES" --budget "$BUDGET")
  [[ -n "$LIMIT" ]] && STEP_ARGS+=(--timeout "$LIMIT")
  [[ -n "$SLOTS" ]] && STEP_ARGS+=(--slots "$SLOTS")
  ((ONLY_FAILED)) && STEP_ARGS+=(--only-failed)
  [[ -n "$SINCE" ]] && STEP_ARGS+=(--since "$SINCE")
  local prev="${PREVIOUS:-$out/results.json}"
  if [[ -n "$PREVIOUS" || -f "$prev" ]]; then STEP_ARGS+=(--previous "$prev"); fi
  return 0
}
# The tests and notebooks come from this checkout, the nbdist they run from the wheel: one
# built from other sources (a wheelhouse made before the last commits) would check old code
# under new tests. Every file of nbdist/ but the built JupyterLab extension must match.
if [[ -n "$NBDIST_WHL" ]]; then
  STALE="$("$PY" - "$NBDIST_WHL" "$ROOT/nbdist" <<'EOF'
import pathlib, sys, zipfile

wheel, src = sys.argv[1], pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    packed = {
        n: z.read(n)
        for n in z.namelist()
        if n.startswith("nbdist/") and not n.startswith("nbdist/labextension/") and not n.endswith("/")
    }
here = {
    "nbdist/" + p.relative_to(src).as_posix(): p.read_bytes()
    for p in src.rglob("*")
    if p.is_file() and "__pycache__" not in p.parts and p.relative_to(src).parts[0] != "labextension"
}
differ = sorted(n for n in packed.keys() | here.keys() if packed.get(n) != here.get(n))
if differ:
    print(f"{len(differ)} file(s) differ, e.g. {', '.join(differ[:3])}")
EOF
  )" || die "could not read '$NBDIST_WHL' with $PY"
  [[ -z "$STALE" ]] || die "$(basename "$NBDIST_WHL") in '$WH' was built from other sources than this checkout's nbdist/ ($STALE): make the wheelhouse again (bash scripts/wheelhouse.sh $WH ...)"
fi
if ((DRY_RUN)); then
  DRY_OUT="${OUTDIR:-${NBDIST_GPU_CHECK_OUT:-${OUT:-$PWD/gpu_check_out}}}"
  steps_args "$DRY_OUT"
  echo "== gpu_check.sh --dry-run: the jobs a run would start (python: \$VPY, the check's venv)"
  exec "$PY" "$ROOT/scripts/gpu_check_steps.py" plan --python '$VPY' "${STEP_ARGS[@]}"
fi
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "'$PY' does not run"
WHVER="$(sed -n 's/^# nbdist wheelhouse: CPython \([0-9.]*\),.*/\1/p' "$WH/wheelhouse.txt" 2>/dev/null)"
if [[ -n "$WHVER" && "$WHVER" != "$PYVER" ]]; then
  die "the wheelhouse is for CPython $WHVER but $PY is $PYVER: make it with scripts/wheelhouse.sh DIR --python $PYVER (or set PYTHON=)"
fi

OUTDIR="${OUTDIR:-${NBDIST_GPU_CHECK_OUT:-${OUT:-$PWD/gpu_check_out}}}"
if ((ONLY_FAILED)) && [[ ! -f "${PREVIOUS:-$OUTDIR/results.json}" ]]; then
  die "--only-failed needs the results.json of an earlier run: none at ${PREVIOUS:-$OUTDIR/results.json} (--previous FILE)"
fi
mkdir -p "$OUTDIR/logs" || die "cannot create '$OUTDIR'"
OUTDIR="$(cd "$OUTDIR" && pwd)"
# Everything printed from here on is also kept in gpu_check.log.
exec > >(tee "$OUTDIR/gpu_check.log") 2>&1

TMP="$(mktemp -d "${TMPDIR:-/tmp}/nbdist-gpu-check.XXXXXX")"
CURRENT="" TOKEN=""  # the running step's `timeout` (its PID is its process group) and token
# --pack: logs, executed notebooks and pytest XML into one logs.tar.gz, at any exit (a
# failure or an interrupt too: those are the runs whose logs are wanted most).
pack_logs() {
  ((PACK)) && [[ -d "$OUTDIR" ]] || return 0
  local packed=() p
  for p in logs notebooks "$OUTDIR"/pytest-*.xml; do
    p="${p#"$OUTDIR"/}"
    [[ -e "$OUTDIR/$p" ]] && packed+=("$p")
  done
  ((${#packed[@]})) || return 0
  if tar -czf "$OUTDIR/logs.tar.gz" -C "$OUTDIR" "${packed[@]}"; then
    (cd "$OUTDIR" && rm -rf -- "${packed[@]}")
    echo "logs, executed notebooks and pytest XML packed into $OUTDIR/logs.tar.gz"
  else
    echo "gpu_check: --pack: tar failed; the files stay in $OUTDIR"
  fi
}
cleanup() {
  if [[ -n "$CURRENT" ]]; then
    kill -INT -- "-$CURRENT" 2>/dev/null
    local i left pids
    for i in 1 2 3 4 5 6 7 8 9 10; do
      left="$(step_pids "$TOKEN")"
      [[ -n "$left" ]] || break
      sleep 1
    done
    if [[ -n "$left" ]]; then read -r -a pids <<<"$left"; kill -KILL "${pids[@]}" 2>/dev/null; fi
  fi
  rm -rf "$TMP"
  pack_logs
}
trap cleanup EXIT
trap 'echo "gpu_check.sh: interrupted"; exit 130' INT TERM

# Results, one entry per step.
NAMES=() RESULTS=() SECS=() NOTES=() FIGURES=()
record() { NAMES+=("$1"); RESULTS+=("$2"); SECS+=("$3"); NOTES+=("$4"); FIGURES+=("${5:-}"); }

# run_step NAME LIMIT LOG DIR CMD...: CMD in DIR under `timeout` (SIGINT first, so Python
# code runs its clean-up; SIGKILL 30 s later), output to LOG; sets RC and ELAPSED.
# Every process of the step carries a token in its environment: those still alive after
# it (a job in a session of its own escapes the process group) are stopped, by PID.
run_step() {
  local name="$1" limit="$2" log="$3" dir="$4"
  shift 4
  echo "== $name  (limit ${limit}s, log ${log#"$OUTDIR"/})"
  local t0=$SECONDS token="$$-$SECONDS-$RANDOM"
  TOKEN="$token"
  (cd "$dir" && NBDIST_GPU_CHECK_STEP="$token" exec timeout -s INT --kill-after=30 "$limit" "$@") \
    >"$log" 2>&1 </dev/null &
  CURRENT=$!
  wait "$CURRENT"
  RC=$?
  CURRENT=""
  ELAPSED=$((SECONDS - t0))
  local left="" i pids
  for i in 1 2 3 4 5 6 7 8 9 10 11; do
    left="$(step_pids "$token")"
    [[ -n "$left" ]] || break
    read -r -a pids <<<"$left"
    case $i in 10) kill -TERM "${pids[@]}" 2>/dev/null ;; 11) kill -KILL "${pids[@]}" 2>/dev/null ;; esac
    sleep 1
  done
  if [[ -n "$left" ]]; then
    echo "   processes of this step still alive 10 s after it: $left(stopped)" | tee -a "$log"
    LEFT_BEHIND+="$name: $left; "
  fi
  if ((RC == 0)); then echo "   pass (${ELAPSED}s)"
  elif ((RC == 124 || RC == 137)); then echo "   TIMEOUT after ${limit}s"
  else echo "   FAIL (exit $RC, ${ELAPSED}s); last lines:"; tail -n 8 "$log" | sed 's/^/   | /'; fi
}
step_pids() {  # PIDs whose environment holds this step's token
  grep -lsxzF "NBDIST_GPU_CHECK_STEP=$1" /proc/[0-9]*/environ 2>/dev/null |
    cut -d/ -f3 | tr '\n' ' ' | sed 's/ *$//'
}
LEFT_BEHIND=""
status_of() { if (($1 == 0)); then echo pass; elif (($1 == 124 || $1 == 137)); then echo timeout; else echo "fail (exit $1)"; fi; }

echo "== nbdist GPU check, $STARTED"
echo "   checkout $ROOT · wheelhouse $WH · output $OUTDIR · python $(command -v "$PY")"

# --- the server's torch, before anything is installed --------------------------------
"$PY" -c 'import torch' 2>/dev/null ||
  die "'$PY' cannot import torch: install the CUDA build of torch for this Python first (set PYTHON= to pick another)"

# --- venv over the system site-packages, offline install -----------------------------
if [[ -n "$VENV_ARG" ]]; then VENV="$VENV_ARG"; else VENV="$TMP/venv"; fi
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv --system-site-packages "$VENV" ||
    die "could not create a venv with $PY (on Debian/Ubuntu: apt install python3-venv)"
fi
VPY="$VENV/bin/python"
# --system-site-packages reaches the base interpreter's packages only: where PYTHON is
# itself a venv (the server's torch installed there), its site-packages come in through
# a .pth file, after the venv's own (so the venv's packages still win).
OUTER="$("$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()) if sys.prefix != sys.base_prefix else "")')"
if [[ -n "$OUTER" ]]; then
  VSITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$OUTER" >"$VSITE/nbdist_gpu_check_outer.pth"
fi
# The server's torch keeps its console scripts in the system's bin: give the venv its own
# torchrun (what the entry point runs), for whatever looks next to sys.executable.
if [[ ! -x "$VENV/bin/torchrun" ]]; then
  printf '#!/bin/sh\n# torchrun of the server torch, for this venv (scripts/gpu_check.sh)\nexec "%s" -m torch.distributed.run "$@"\n' \
    "$VPY" >"$VENV/bin/torchrun"
  chmod +x "$VENV/bin/torchrun"
fi
export PATH="$VENV/bin:$PATH"
# Every process (tests, kernels, ranks, benchmarks) runs this checkout's nbdist.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# Jupyter and IPython state of this run stays in the temporary directory.
for v in IPYTHONDIR JUPYTER_RUNTIME_DIR JUPYTER_DATA_DIR JUPYTER_CONFIG_DIR; do
  export "$v=$TMP/${v,,}"
  mkdir -p "$TMP/${v,,}"
done

# DeepSpeed and HTA, where the wheelhouse has them (scripts/wheelhouse.sh --with-deepspeed,
# --with-hta).
DS_WHL="" HTA_WHL=""
for w in "$WH"/deepspeed-*.whl; do [[ -f "$w" ]] && DS_WHL="$w"; done
for w in "$WH"/holistictraceanalysis-*.whl; do [[ -f "$w" ]] && HTA_WHL="$w"; done
# The requirements but torch of nbdist (and DeepSpeed, HTA), read from their wheels:
# resolving them never involves the server's torch, so pip can neither try to reinstall it
# nor trip over how it was installed. HTA's jupyterlab (its own notebooks) is not in the
# wheelhouse and its networkx comes with torch. The wheels themselves go in afterwards, --no-deps.
"$VPY" - "$NBDIST_WHL" ${DS_WHL:+"$DS_WHL"} ${HTA_WHL:+"$HTA_WHL"} >"$TMP/requirements.txt" <<'EOF'
import re
import sys
import zipfile

for path in sys.argv[1:]:
    wheel = zipfile.ZipFile(path)
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()
            if name not in ("torch", "jupyterlab", "networkx") and "extra ==" not in req:
                print(req)
EOF
PKGS=(-r "$TMP/requirements.txt" pytest pytest-timeout nbclient nbformat)
if compgen -G "$WH/torchao-*.whl" >/dev/null; then PKGS+=(torchao); fi
run_step "install (offline)" 900 "$OUTDIR/logs/install.log" "$ROOT" \
  "$VPY" -m pip install --no-index --find-links "$WH" "${PKGS[@]}"
INSTALL_RC=$RC
if ((RC == 0)); then
  # The nbdist wheel (and DeepSpeed's, HTA's) of this wheelhouse (their dependencies are in
  # place now), even over a package of the same version number already in a reused venv.
  "$VPY" -m pip install --no-index --no-deps --force-reinstall "$NBDIST_WHL" ${DS_WHL:+"$DS_WHL"} \
    ${HTA_WHL:+"$HTA_WHL"} \
    >>"$OUTDIR/logs/install.log" 2>&1 || INSTALL_RC=$?
  # HTA's jupyterlab is left out on purpose (above): not an unmet requirement worth a word.
  CHECK="$("$VPY" -m pip check 2>&1 | grep -v '^holistictraceanalysis .* requires jupyterlab')"
  echo "$CHECK" >>"$OUTDIR/logs/install.log"
  if grep -qE ' requires |has requirement' <<<"$CHECK"; then
    echo "   pip check reports unmet requirements (see logs/install.log)"
  fi
fi
record "install from the wheelhouse (\`pip install --no-index\`)" "$(status_of "$INSTALL_RC")" "$ELAPSED" \
  "$(find "$WH" -maxdepth 1 -name '*.whl' | wc -l) wheels in the wheelhouse"
((INSTALL_RC == 0)) || echo "   the install failed: the steps below will likely fail too"

# --- versions and devices ------------------------------------------------------------
"$VPY" - >"$OUTDIR/versions.txt" 2>"$OUTDIR/logs/versions.err" <<'EOF'
import platform
import sys

import torch

print("python", platform.python_version())
print("torch", torch.__version__)
print("torch_path", torch.__file__)
print("cuda", torch.version.cuda or "none")
print("cuda_available", torch.cuda.is_available())
print("gpus", torch.cuda.device_count() if torch.cuda.is_available() else 0)
nccl = "none"
try:
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
except Exception as exc:  # no NCCL in this build
    nccl = f"unavailable ({type(exc).__name__})"
print("nccl", nccl)
try:
    import nbdist

    print("nbdist", getattr(nbdist, "__version__", "?"), nbdist.__file__)
except Exception as exc:
    print("nbdist", f"not importable: {exc!r}")
sys.exit(0 if torch.cuda.is_available() else 3)
EOF
CUDA_RC=$?
val() { awk -v k="$1" '$1 == k { $1 = ""; sub(/^ /, ""); print; exit }' "$OUTDIR/versions.txt"; }
sed 's/^/   /' "$OUTDIR/versions.txt"
case "$(val torch_path)" in "$VENV"/*) echo "   WARNING: torch was installed into the venv: not the server's CUDA build" ;; esac
if command -v nvidia-smi >/dev/null; then
  nvidia-smi -L | tee "$OUTDIR/nvidia-smi-L.txt" | sed 's/^/   /'
  nvidia-smi >"$OUTDIR/nvidia-smi.txt" 2>&1
  GPU_NAMES="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
  DRIVER="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)"
  DEVICE="$(echo "$GPU_NAMES" | sort | uniq -c | awk '{ n = $1; $1 = ""; printf "%s%d ×%s", (NR > 1 ? ", " : ""), n, $0 }')"
  DEVICE="$DEVICE (driver $DRIVER)"
else
  echo "   nvidia-smi: not found"
  DEVICE="no nvidia-smi"
fi
if ((CUDA_RC != 0)); then
  if ((ALLOW_CPU)); then
    echo "   torch.cuda.is_available() is False: going on (--allow-cpu)"
    DEVICE="$DEVICE; torch sees no CUDA device (--allow-cpu)"
  else
    cat "$OUTDIR/logs/versions.err" >&2
    die "torch.cuda.is_available() is False with $PY (torch $(val torch), CUDA $(val cuda)): this check needs the server's CUDA build of torch and a visible GPU"
  fi
fi

# --- the jobs ---------------------------------------------------------------------------
# A previous results.json in OUTDIR is kept for --only-failed: moved aside before this run.
steps_args "$OUTDIR"
JOBS_T0=$SECONDS
"$VPY" "$ROOT/scripts/gpu_check_steps.py" run --python "$VPY" "${STEP_ARGS[@]}"
JOBS_RC=$?
JOBS_S=$((SECONDS - JOBS_T0))

# --- results block ----------------------------------------------------------------------
if [[ -d "$ROOT/.git" ]] && command -v git >/dev/null; then
  COMMIT="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
  [[ -z "$(git -C "$ROOT" status --porcelain 2>/dev/null)" ]] || COMMIT="$COMMIT + uncommitted changes"
else
  COMMIT="${NBDIST_COMMIT:-unknown}"
fi
FAILED=0
{
  echo "### GPU check, $STARTED"
  echo
  echo "- device: $DEVICE"
  echo "- commit: $COMMIT"
  echo "- Python $(val python) · torch $(val torch) · CUDA $(val cuda) · NCCL $(val nccl)"
  echo "- \`bash scripts/gpu_check.sh\` (steps: $STEPS); jobs ${JOBS_S} s; logs in \`$(basename "$OUTDIR")/logs/\`"
  [[ -z "$LEFT_BEHIND" ]] || echo "- processes left behind (killed): $LEFT_BEHIND"
  echo
  echo "| step | result | time | notes |"
  echo "|---|---|---|---|"
  for i in "${!NAMES[@]}"; do
    echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${SECS[$i]} s | ${NOTES[$i]//|/\\|} |"
    [[ "${RESULTS[$i]}" == pass || "${RESULTS[$i]}" == skip ]] || FAILED=$((FAILED + 1))
  done
  if [[ -f "$OUTDIR/results-table.md" ]]; then
    tail -n +3 "$OUTDIR/results-table.md"
  else
    echo "| jobs | fail (exit $JOBS_RC) | ${JOBS_S} s | no results-table.md: see gpu_check.log |"
  fi
} >"$OUTDIR/results.md"
echo
echo "== results (also in $OUTDIR/results.md)"
echo
cat "$OUTDIR/results.md"
echo
if ((FAILED || JOBS_RC)); then
  echo "gpu_check: a step failed (exit $JOBS_RC from the jobs; $FAILED set-up step(s) failed)"
  exit 1
fi
echo "gpu_check: every step passed (skips are listed above)"
