#!/usr/bin/env bash
# Runs on a machine with internet (Linux, Python >= 3.11 with pip, node for the
# JupyterLab extension): fills DIR with the manylinux x86_64 wheels that nbdist needs
# at run time on a GPU server without internet, for one Python version (default 3.12):
#   - nbdist's dependencies as pyproject.toml lists them, except torch: the server
#     keeps its own CUDA build, so no torch, nvidia-* (but nvidia-ml-py) or triton wheel
#     is ever downloaded;
#   - what scripts/gpu_check.sh runs there: pytest, pytest-timeout, nbclient, nbformat
#     (versions from the [test] extra); with --with-torchao also torchao (8-bit
#     optimizers for a GPU test; 3.2 MiB, which takes the set past 60 MB: raise --max-mb);
#     with --with-deepspeed also the [deepspeed] extra (example 30 and its GPU test;
#     DeepSpeed publishes source only, so its wheel is built here: pure Python, no ops);
#     with --with-hta also HolisticTraceAnalysis (the [profile] extra: the GPU profile's
#     breakdown test) and what it needs but jupyterlab (its own notebooks) and networkx
#     (the server's torch has it);
#   - minus what --leave-out names: packages the server already has (a CUDA image's
#     numpy and pandas are 28 MB of the set), which pip there then takes as installed;
#   - an nbdist wheel built from this checkout, with the JupyterLab extension inside.
# The set is resolved once (pip's resolver, metadata only), then downloaded with
# --no-deps. DIR ends up holding exactly this set (stale wheels are removed), so
# running it again is safe. It fails, leaving DIR as it was, if the set would reach
# 60 MB, decimal (--max-mb).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LIMIT_MB=60
# Tools scripts/gpu_check.sh needs on the server, taken from the [test] extra.
GPU_CHECK_TOOLS=(pytest pytest-timeout nbclient nbformat)
# Never in the wheelhouse: the server's own torch and what it brings.
EXCLUDE_RE='^(torch|triton|pytorch-triton.*|nvidia-.*|cuda-.*)$'
KEEP_RE='^nvidia-ml-py$'

usage() {
  cat <<EOF
usage: bash scripts/wheelhouse.sh DIR [--python X.Y] [--with-torchao] [--with-deepspeed]
                                     [--with-hta] [--leave-out NAMES] [--max-mb N]

Download into DIR the wheels nbdist needs on an offline Linux x86_64 GPU server
(everything but torch and its CUDA libraries), plus an nbdist wheel built from
this checkout with its JupyterLab extension. Then, on the server:
  bash scripts/gpu_check.sh DIR
or, for daily use:
  pip install --no-index --find-links DIR nbdist

options:
  --python X.Y    the server's Python version (default 3.12; 3.10 or newer)
  --with-torchao  add torchao (8-bit optimizers, for a GPU test)
  --with-deepspeed
                  add the [deepspeed] extra (DeepSpeed ZeRO: example 30 and its GPU
                  test); DeepSpeed's wheel is built here from its source release
  --with-hta      add HolisticTraceAnalysis (the [profile] extra, for the GPU profile's
                  breakdown test) without jupyterlab, which only its own notebooks use
  --leave-out NAMES
                  comma-separated packages to leave out because the server has them
                  already (e.g. numpy,pandas); pip there must find them installed, in
                  versions that meet nbdist's requirements
  --max-mb N      the size DIR must stay under, in MB of 10^6 bytes (default ${LIMIT_MB})
  -h, --help      this help

Needs internet, pip >= 23 and node (to build the JupyterLab extension).
If the set reaches the size limit the script fails and leaves DIR as it was.
EOF
}

die() { echo "wheelhouse.sh: error: $*" >&2; exit 2; }

DIR=""
PYVER="3.12"
WITH_TORCHAO=0
WITH_DEEPSPEED=0
WITH_HTA=0
LEAVE_OUT=""
while (($#)); do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --python)
      (($# >= 2)) || die "--python needs a version such as 3.12"
      PYVER="$2"; shift 2 ;;
    --python=*) PYVER="${1#--python=}"; shift ;;
    --with-torchao) WITH_TORCHAO=1; shift ;;
    --with-deepspeed) WITH_DEEPSPEED=1; shift ;;
    --with-hta) WITH_HTA=1; shift ;;
    --leave-out)
      (($# >= 2)) || die "--leave-out needs package names, comma-separated (e.g. numpy,pandas)"
      LEAVE_OUT="$2"; shift 2 ;;
    --max-mb)
      (($# >= 2)) || die "--max-mb needs a number of MB"
      LIMIT_MB="$2"; shift 2 ;;
    -*) die "unknown option '$1' (see --help)" ;;
    *)
      [[ -z "$DIR" ]] || die "one DIR only (got '$DIR' and '$1')"
      DIR="$1"; shift ;;
  esac
done
[[ -n "$DIR" ]] || { usage >&2; die "missing DIR"; }
if [[ ! "$PYVER" =~ ^3\.([0-9]+)$ ]] || ((BASH_REMATCH[1] < 10)); then
  die "--python '$PYVER': nbdist needs Python 3.10 or newer, given as X.Y (e.g. 3.12)"
fi
PYTAG="cp3${BASH_REMATCH[1]}"
[[ "$LIMIT_MB" =~ ^[1-9][0-9]*$ ]] || die "--max-mb '$LIMIT_MB': a whole number of MB"
if [[ -n "$LEAVE_OUT" && ! "$LEAVE_OUT" =~ ^[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*$ ]]; then
  die "--leave-out '$LEAVE_OUT': package names separated by commas, e.g. numpy,pandas"
fi
if [[ -e "$DIR" && ! -d "$DIR" ]]; then die "'$DIR' exists and is not a directory"; fi

# The Python that runs pip here (any version; it only resolves and downloads).
if [[ -n "${PYTHON:-}" ]]; then HOSTPY="$PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then HOSTPY="$ROOT/.venv/bin/python"
else HOSTPY="python3"; fi
"$HOSTPY" - <<'EOF' || die "$HOSTPY: need Python >= 3.11 with pip >= 23 (set PYTHON=...)"
import sys
import pip
assert sys.version_info >= (3, 11), "tomllib"
assert int(pip.__version__.split(".")[0]) >= 23, "pip --dry-run --report"
EOF
command -v node >/dev/null || die "node is needed to build nbdist's JupyterLab extension"

mkdir -p "$DIR" || die "cannot create '$DIR'"
DIR="$(cd "$DIR" && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/nbdist-wheelhouse.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
PIP=("$HOSTPY" -m pip --disable-pip-version-check)
# Every manylinux tag up to glibc 2.28, what torch's own Linux wheels need (so a server
# that runs CUDA torch has it); pip does not widen a given --platform to older ones.
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$PYTAG")
for m in $(seq 28 -1 5); do TARGET+=(--platform "manylinux_2_${m}_x86_64"); done
TARGET+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)

echo "== reading nbdist's requirements from pyproject.toml"
EXTRAS=()
((WITH_TORCHAO)) && EXTRAS+=(torchao)
PYPROJECT_EXTRAS=()
((WITH_DEEPSPEED)) && PYPROJECT_EXTRAS+=(deepspeed)
"$HOSTPY" - "$ROOT/pyproject.toml" "${GPU_CHECK_TOOLS[*]}" "${EXTRAS[*]}" "${PYPROJECT_EXTRAS[*]}" \
  >"$WORK/requirements.txt" <<'EOF' ||
import re
import sys
import tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
tools, extras, groups = sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split()


def name(req):
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


for req in project["dependencies"]:
    if name(req) != "torch":
        print(req)
test = {name(r): r for r in project.get("optional-dependencies", {}).get("test", [])}
for tool in tools:
    print(test.get(tool, tool))
for extra in extras:
    print(extra)
for group in groups:
    for req in project["optional-dependencies"][group]:
        print(req)
EOF
  die "could not read dependencies from $ROOT/pyproject.toml"
sed 's/^/   /' "$WORK/requirements.txt"

# pin_as_is WHEEL NAME...: WHEEL goes into the set as it is (pinned in built_pins.txt); its
# requirements but the NAMEs replace its own line in requirements.txt, to be resolved with
# the rest.
pin_as_is() {
  "$HOSTPY" - "$WORK/requirements.txt" "$@" >>"$WORK/built_pins.txt" <<'EOF'
import re
import sys
import zipfile
from email.parser import Parser

reqs, wheel, drop = sys.argv[1], sys.argv[2], set(sys.argv[3:])
archive = zipfile.ZipFile(wheel)
meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
meta = Parser().parsestr(archive.read(meta_name).decode())


def name(req):
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


own = name(meta["Name"])
needs = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
lines = [line for line in open(reqs).read().splitlines() if name(line) != own]
lines += [r for r in needs if name(r) not in drop]
open(reqs, "w").write("\n".join(lines) + "\n")
print(f"{meta['Name']}=={meta['Version']}")
EOF
}

# Packages published as source only (DeepSpeed) are built into wheels first, here; the
# resolver and the download below then find them beside the binary-only index.
BUILT="$WORK/built"
mkdir -p "$BUILT"
: >"$WORK/built_pins.txt"
if ((WITH_DEEPSPEED)); then
  ds_req="$(grep -E '^deepspeed([^a-zA-Z0-9_.-]|$)' "$WORK/requirements.txt" | head -1)"
  [[ -n "$ds_req" ]] || die "pyproject.toml's [deepspeed] extra does not name deepspeed"
  echo "== building a wheel of $ds_req (source release only; pure Python, no ops compiled)"
  DS_BUILD_OPS=0 "${PIP[@]}" wheel --quiet --no-deps --no-binary deepspeed -w "$BUILT" "$ds_req" \
    >"$WORK/deepspeed-build.log" 2>&1 || {
    tail -30 "$WORK/deepspeed-build.log" >&2
    die "building the DeepSpeed wheel failed (log above)"
  }
  # The built wheel is pinned as it is; what it needs is resolved with the rest, except
  # torch: DeepSpeed requires it, and resolving torch would bring its own dependencies
  # (sympy, networkx, ...; 10 MB) that the server's torch already has.
  pin_as_is "$BUILT"/deepspeed-*.whl torch || die "could not read the DeepSpeed wheel's requirements"
fi
if ((WITH_HTA)); then
  hta_req="$("$HOSTPY" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["profile"][0])' "$ROOT/pyproject.toml")" ||
    die "pyproject.toml has no [profile] extra naming HolisticTraceAnalysis"
  echo "== downloading $hta_req (its requirements but jupyterlab and networkx go with the rest)"
  "${PIP[@]}" download --quiet --no-deps "${TARGET[@]}" -d "$BUILT" "$hta_req" ||
    die "downloading $hta_req failed (output above)"
  # jupyterlab (and its server, 15 MB) serves HTA's own notebooks, not its analyses;
  # networkx comes with the server's torch.
  pin_as_is "$BUILT"/holistictraceanalysis-*.whl torch jupyterlab networkx ||
    die "could not read the HolisticTraceAnalysis wheel's requirements"
fi

echo "== resolving for CPython $PYVER manylinux x86_64 (metadata only)"
"${PIP[@]}" install --quiet --dry-run --ignore-installed --target "$WORK/none" \
  --find-links "$BUILT" --report "$WORK/report.json" "${TARGET[@]}" -r "$WORK/requirements.txt" ||
  die "pip could not resolve the requirements for Python $PYVER (output above)"
"$HOSTPY" - "$WORK/report.json" "$EXCLUDE_RE" "$KEEP_RE" "$LEAVE_OUT" "$WORK/excluded.txt" \
  "$WORK/left_out.txt" >"$WORK/pinned.txt" <<'EOF' ||
import json
import re
import sys

report = json.load(open(sys.argv[1]))
exclude, keep = re.compile(sys.argv[2]), re.compile(sys.argv[3])


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


leave_out = {norm(n) for n in sys.argv[4].split(",") if n}
resolved = {norm(item["metadata"]["name"]) for item in report["install"]}
unknown = sorted(leave_out - resolved)
if unknown:
    sys.exit(
        f"wheelhouse.sh: error: --leave-out {','.join(unknown)}: not in the resolved set, so "
        f"nothing to leave out (check the spelling; the set: {', '.join(sorted(resolved))})"
    )
with open(sys.argv[5], "w") as torch_side, open(sys.argv[6], "w") as left:
    for item in report["install"]:
        meta = item["metadata"]
        pin = f"{meta['name']}=={meta['version']}"
        if exclude.match(norm(meta["name"])) and not keep.match(norm(meta["name"])):
            print(pin, file=torch_side)
        elif norm(meta["name"]) in leave_out:
            print(pin, file=left)
        else:
            print(pin)
EOF
  die "could not read pip's resolution report (or --leave-out: above)"
cat "$WORK/built_pins.txt" >>"$WORK/pinned.txt"
if [[ -s "$WORK/excluded.txt" ]]; then
  echo "   left out (the server's torch provides them): $(tr '\n' ' ' <"$WORK/excluded.txt")"
fi
if [[ -s "$WORK/left_out.txt" ]]; then
  echo "   left out (--leave-out: the server must have them): $(tr '\n' ' ' <"$WORK/left_out.txt")"
fi

echo "== downloading $(wc -l <"$WORK/pinned.txt") wheels (--no-deps; wheels already in DIR are reused)"
mkdir -p "$WORK/wheels"
"${PIP[@]}" download --quiet --no-deps --find-links "$DIR" --find-links "$BUILT" -d "$WORK/wheels" \
  "${TARGET[@]}" \
  -r "$WORK/pinned.txt" || die "pip download failed (output above)"

echo "== building the nbdist wheel (JupyterLab extension built in a copy of this checkout)"
SRC="$WORK/src"
mkdir -p "$SRC"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  # Tracked and untracked-but-not-ignored files: what is in the working tree now.
  (cd "$ROOT" && git ls-files -co --exclude-standard | while IFS= read -r f; do
    [[ -f "$f" ]] && printf '%s\0' "$f"
  done | tar --null -T - -cf -) | tar -xf - -C "$SRC" || die "copying the checkout failed"
else
  (cd "$ROOT" && tar -cf - --exclude=./.git --exclude=./.venv --exclude=./wheelhouse \
    --exclude=./gpu_check_out --exclude=./artifacts --exclude=./build --exclude=./dist \
    --exclude=./nbdist/labextension --exclude=./labextension/node_modules \
    --exclude=./labextension/lib --exclude=./labextension/.yarn --exclude=__pycache__ .) |
    tar -xf - -C "$SRC" || die "copying the checkout failed"
fi
# node_modules and the yarn state save the extension build a fresh install (and the npm
# registry); copied, not linked, so the build never writes into this checkout.
for d in labextension/node_modules labextension/.yarn; do
  if [[ -d "$ROOT/$d" ]]; then cp -a "$ROOT/$d" "$SRC/$d" || die "copying $d failed"; fi
done
rm -rf "$SRC/nbdist/labextension"
if ! "${PIP[@]}" wheel --quiet --no-deps -w "$WORK/wheels" "$SRC" >"$WORK/build.log" 2>&1; then
  tail -40 "$WORK/build.log" >&2
  die "building the nbdist wheel failed (log above)"
fi
NBDIST_WHL=""
for w in "$WORK"/wheels/nbdist-*.whl; do [[ -f "$w" ]] && NBDIST_WHL="$w"; done
[[ -n "$NBDIST_WHL" ]] || die "no nbdist wheel was built"
"$HOSTPY" - "$NBDIST_WHL" <<'EOF' || die "the nbdist wheel lacks the JupyterLab extension"
import sys
import zipfile

names = zipfile.ZipFile(sys.argv[1]).namelist()
need = "/data/share/jupyter/labextensions/nbdist/package.json"
assert any(n.endswith(need) for n in names), need
assert any("/labextensions/nbdist/static/" in n for n in names), "static/"
EOF

echo "== checking the set"
bad=""
for w in "$WORK"/wheels/*.whl; do
  w="${w##*/}"
  n="$(echo "${w%%-*}" | tr '_A-Z' '-a-z')"
  if [[ "$n" =~ $EXCLUDE_RE && ! "$n" =~ $KEEP_RE ]]; then bad+="$w "; fi
done
[[ -z "$bad" ]] || die "torch-side wheels would land in DIR: $bad"

# The manifest goes with the wheels; the size is that of every file DIR will hold.
{
  echo "# nbdist wheelhouse: CPython $PYVER, manylinux x86_64; torch not included"
  echo "# built $(date -u +%Y-%m-%dT%H:%M:%SZ) by scripts/wheelhouse.sh"
  if [[ -s "$WORK/left_out.txt" ]]; then
    echo "# left out, the server must have them: $(tr '\n' ' ' <"$WORK/left_out.txt")"
  fi
  for w in "$WORK"/wheels/*.whl; do echo "${w##*/}"; done
} >"$WORK/wheels/wheelhouse.txt"
count="$(find "$WORK/wheels" -maxdepth 1 -name '*.whl' | wc -l)"
bytes="$(find "$WORK/wheels" -maxdepth 1 -type f -printf '%s\n' | awk '{ s += $1 } END { print s }')"
mib="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')"
du -k "$WORK"/wheels/*.whl | sort -k1,1nr | while read -r k w; do printf '   %6d KiB  %s\n' "$k" "${w##*/}"; done
mb="$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1000000 }')"
if ((bytes >= LIMIT_MB * 1000000)); then
  echo "wheelhouse.sh: error: the set is $mb MB ($count wheels), not under the ${LIMIT_MB} MB limit; $DIR left as it was" >&2
  exit 1
fi

# DIR becomes exactly the new set.
find "$DIR" -maxdepth 1 \( -name '*.whl' -o -name wheelhouse.txt \) -delete
mv "$WORK"/wheels/* "$DIR"/
echo "wheelhouse: $count wheels, $mb MB = $mib MiB ($bytes bytes) in $DIR"
