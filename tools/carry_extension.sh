#!/usr/bin/env bash
# Build tlt_kernels._C on this machine for the GPU machine (CPython 3.12, sm_90a) and write it xz-compressed to
# .peer/soz/_C.so.xz (about 6 MB; the .so is about 58 MB, too large to carry beside the model's pieces). The extension
# links no libtorch and cudart statically, so a build here with nvcc, CMake and pybind11 runs there; a device call that
# carries .peer/soz installs it with tools/device_install.sh in seconds instead of building it (about 100 s there):
#   bash tools/carry_extension.sh [PYTHON3.12]      (on your machine, from the repository root; 5-10 min on 2 cores)
# The sources' hash goes beside it (.peer/soz/source_hash): a copy whose csrc/ or CMakeLists.txt differs builds its
# own. PYTHON3.12 defaults to python3.12 on PATH, then pyenv's newest 3.12; it needs pybind11 (pip install pybind11).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
git check-ignore -q .peer/x || { echo "carry_extension.sh: .peer/ is not ignored by git; add /.peer/ to .git/info/exclude" >&2; exit 1; }
is_312() { [ -n "$1" ] && "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2> /dev/null; }
PY=${1:-}
if [ -z "$PY" ]; then  # python3.12 on PATH (a pyenv shim may fail), then pyenv's 3.12 versions, newest first
  for candidate in "$(command -v python3.12 2> /dev/null)" $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python \
      2> /dev/null | sort -rV); do
    if is_312 "$candidate"; then PY=$candidate; break; fi
  done
fi
is_312 "$PY" || { echo "carry_extension.sh: no CPython 3.12 found (the GPU machine's); pass its path" >&2; exit 2; }
PYBIND11_DIR=$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())') \
  || { echo "carry_extension.sh: $PY has no pybind11 ($PY -m pip install pybind11)" >&2; exit 2; }
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
cmake -S . -B "$build/cmake" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" -DTLT_CUDA_ARCHS=90a \
  -DTLT_OUTPUT_DIR="$build/out" -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$PYBIND11_DIR" -GNinja > "$build/configure.log"
cmake --build "$build/cmake" -j "$(nproc)" > "$build/build.log" || { tail -30 "$build/build.log" >&2; exit 3; }
mkdir -p .peer/soz
xz -9 -T0 -c "$build"/out/_C.cpython-312-*.so > .peer/soz/_C.so.xz
bash tools/device_install.sh --source-hash > .peer/soz/source_hash  # what device_install.sh checks the copy against
ls -l .peer/soz
