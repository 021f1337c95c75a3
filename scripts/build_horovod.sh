#!/usr/bin/env bash
# Build Horovod 0.28.1 (its last release) for the torch in .venv, on CPU with gloo. Opt-in: not part
# of the default test run; about 3 minutes on 2 cores.
#
#   bash scripts/build_horovod.sh            # into build/horovod-venv, a venv layered on .venv
#   bash scripts/build_horovod.sh .venv      # or straight into .venv (or any venv that has torch)
#
# The layered venv sees every package of .venv (a .pth file adds .venv's site-packages) and holds
# only Horovod, so .venv stays as it was. Use its python for the real-Horovod path:
#   build/horovod-venv/bin/python -m pytest tests/dist/test_horovod_real.py   (NBDIST_TEST_HOROVOD=1)
#   build/horovod-venv/bin/python scripts/run_notebook.py examples/17_horovod.ipynb
#
# Why patches: the sdist hard-codes C++14 (CMakeLists.txt, horovod/torch/CMakeLists.txt) while
# torch >= 2.1 headers need C++17 ("#error C++17 or later compatible compiler is required to use
# PyTorch"); switching only horovod/torch fails to link against the bundled gloo, built as C++11
# (duplicate gloo::rendezvous::Store::kDefaultTimeout), so gloo gets -std=c++17 too. cmake must be
# 3.x (Debian's 3.25): cmake 4 refuses gloo's old cmake_minimum_required.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then
  cat <<'USAGE'
usage: bash scripts/build_horovod.sh [VENV]

Builds Horovod 0.28.1 for the torch in .venv (CPU, gloo; about 3 minutes on 2 cores) into
VENV: default build/horovod-venv, a venv layered on .venv that holds only Horovod
(give .venv, or any venv with torch, to install it there). Needs cmake 3.x and g++
(installed from Debian if missing). Then:
  build/horovod-venv/bin/python scripts/run_notebook.py examples/17_horovod.ipynb
USAGE
  exit 0
fi
if [[ $# -gt 1 || "${1:-}" == -* ]]; then
  echo "scripts/build_horovod.sh: takes one venv directory, got: $*; see --help" >&2
  exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="$ROOT/.venv"
TARGET="${1:-$ROOT/build/horovod-venv}"
VERSION=0.28.1
WORK="$ROOT/build/horovod-src"

[[ -x "$BASE/bin/python" ]] || { echo "no $BASE: run 'source scripts/_env.sh' first" >&2; exit 1; }
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  echo "== installing Debian's cmake and g++"
  SUDO=""; [[ "$(id -u)" != 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends cmake g++ make
fi
cmake_major="$(cmake --version | head -1 | sed -E 's/[^0-9]*([0-9]+).*/\1/')"
if [[ "$cmake_major" != 3 ]]; then
  echo "cmake $(cmake --version | head -1) found first on PATH: Horovod's bundled gloo needs cmake 3.x" \
    "(apt-get install cmake; pip's cmake 4 refuses it)" >&2
  exit 1
fi

if [[ ! -x "$TARGET/bin/python" ]]; then
  echo "== creating $TARGET on top of $BASE"
  "$BASE/bin/python" -m venv "$TARGET"
fi
PY="$TARGET/bin/python"
if [[ "$(cd "$TARGET" && pwd)" != "$(cd "$BASE" && pwd)" ]]; then
  base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # addsitedir, not a bare path: .venv's own .pth files (nbdist's editable install) must run too.
  echo "import site; site.addsitedir('$base_site')" > "$site/_nbdist_base_venv.pth"
fi
"$PY" -c 'import torch' || { echo "torch is not importable from $PY" >&2; exit 1; }
# Building without isolation (the build must see torch) uses the venv's setuptools, which
# needs the wheel package for bdist_wheel.
"$PY" -c 'import wheel' 2>/dev/null || "$PY" -m pip install --quiet wheel

rm -rf "$WORK"
mkdir -p "$WORK"
echo "== fetching horovod==$VERSION (sdist)"
"$PY" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation -d "$WORK" "horovod==$VERSION"
tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/horovod-$VERSION"

echo "== patching C++14 -> C++17 (Horovod and its gloo)"
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/; s/-std=c++14/-std=c++17/g' \
  "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
sed -i 's/-std=c++11/-std=c++17/g' "$SRC/third_party/gloo/CMakeLists.txt"
for f in CMakeLists.txt horovod/torch/CMakeLists.txt third_party/gloo/CMakeLists.txt; do
  grep -q 'CMAKE_CXX_STANDARD 17\|-std=c++17' "$SRC/$f" \
    || { echo "the C++17 patch did not apply to $f: the sdist is not the expected one" >&2; exit 1; }
done

echo "== building and installing into $TARGET (a few minutes)"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
export MAKEFLAGS="${MAKEFLAGS:--j2}"
"$PY" -m pip install --quiet --no-build-isolation --no-deps "$SRC"
"$PY" - <<'EOF'
import horovod, horovod.torch as hvd
print(f"== horovod {horovod.__version__}: gloo built {hvd.gloo_built()}, mpi built {hvd.mpi_built()}")
assert hvd.gloo_built(), "Horovod built without gloo"
EOF
rm -rf "$WORK"
