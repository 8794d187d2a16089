#!/usr/bin/env bash
# On the GPU machine, from the repository root: install the package (editable, no dependencies) with tlt_kernels._C.
# The extension comes from, in order: /tmp/keep (an earlier call on the same warm machine), .peer/soz/_C.so.xz
# (tools/carry_extension.sh, carried), each only when built from these sources (the hash of csrc/ and CMakeLists.txt,
# which a stale extension would not match); else it is built here (about 100 s) and kept in /tmp/keep.
#   bash tools/device_install.sh [LOG]       (LOG default /tmp/device_install.log)
#   bash tools/device_install.sh --source-hash   (print the sources' hash and exit)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source_hash() { find csrc CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1; }
if [ "${1:-}" = --source-hash ]; then source_hash; exit 0; fi
LOG=${1:-/tmp/device_install.log}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1
export TLT_CUDA_ARCHS=${TLT_CUDA_ARCHS:-90a} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
SO=tlt_kernels/_C.cpython-312-x86_64-linux-gnu.so
HASH=$(source_hash)
rm -f $SO  # never an extension of unknown sources (a copy sent again keeps an earlier build in the tree)
from="a build here"
if [ "$(cat /tmp/keep/source_hash 2> /dev/null)" = "$HASH" ]; then
  cp /tmp/keep/_C.so $SO && from=/tmp/keep
elif [ "$(cat .peer/soz/source_hash 2> /dev/null)" = "$HASH" ]; then
  python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    .peer/soz/_C.so.xz $SO && from=.peer/soz
elif [ -f .peer/soz/_C.so.xz ]; then
  echo "device_install.sh: .peer/soz/_C.so.xz was built from other sources; building here" >&2
fi
if [ -f $SO ]; then
  TLT_BUILD_CUDA=0 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$LOG" 2>&1
else
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$LOG" 2>&1
fi
rc=$?
if [ -f $SO ] && [ "$from" != /tmp/keep ]; then
  mkdir -p /tmp/keep && cp $SO /tmp/keep/_C.so && echo "$HASH" > /tmp/keep/source_hash
fi
python3 -c "import tlt_kernels, sys; print('device_install.sh: _C', 'available' if tlt_kernels.cuda_extension_available() \
else 'NOT available', 'from', sys.argv[1])" "$from"
exit $rc
