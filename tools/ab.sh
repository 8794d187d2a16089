#!/usr/bin/env bash
# Same-run A/B of a code change on the GPU machine, in one device call (docs/PERFORMANCE.md compares only figures of one
# run): from the repository root,
#   bash tools/ab.sh CHANGE.patch -- python -m tools.profile_acceptance --clusters 0
# installs the tree as it is (A) and runs the command, applies the patch (patch -p1: `git diff > CHANGE.patch` here),
# reinstalls (B: CMake rebuilds only what the patch touches) and runs the command again, then reverses the patch and
# reinstalls A, so the tree is left as it came. Logs: $OUT/ab_A.log, $OUT/ab_B.log (install logs: $OUT/ab_install.log).
# AB_ROUNDS=2 runs A, B, A, B (the second pair shows the run-to-run spread). AB_RESTORE=0 leaves B's build installed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ $# -lt 3 ] || [ "$2" != "--" ]; then
  echo "usage: bash tools/ab.sh CHANGE.patch -- COMMAND [ARGS...]" >&2
  exit 2
fi
PATCH=$(readlink -f "$1")
shift 2
OUT=${OUT:-/tmp/ab_out}
mkdir -p "$OUT"
export TLT_CUDA_ARCHS=${TLT_CUDA_ARCHS:-90a} PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
PY=$(command -v python || command -v python3)

command -v patch > /dev/null || { echo "ab.sh: needs patch(1) on PATH" >&2; exit 2; }
[ -f "$PATCH" ] || { echo "ab.sh: no patch file $PATCH" >&2; exit 2; }
patch -p1 --dry-run --silent < "$PATCH" > /dev/null || { echo "ab.sh: $PATCH does not apply to this tree" >&2; exit 2; }

install() {  # install LABEL
  echo "=== install $1" >> "$OUT/ab_install.log"
  "$PY" -m pip install --no-build-isolation --no-deps -e . >> "$OUT/ab_install.log" 2>&1 || {
    echo "ab.sh: install of $1 failed (see ab_install.log)" >&2; return 1; }
}

status=0
for round in $(seq 1 "${AB_ROUNDS:-1}"); do
  install A && { echo "=== A (round $round)" >> "$OUT/ab_A.log"; "$@" >> "$OUT/ab_A.log" 2>&1; echo "=== exit $?" >> "$OUT/ab_A.log"; } || status=1
  patch -p1 --silent < "$PATCH" || { echo "ab.sh: patch failed" >&2; exit 1; }
  install B && { echo "=== B (round $round)" >> "$OUT/ab_B.log"; "$@" >> "$OUT/ab_B.log" 2>&1; echo "=== exit $?" >> "$OUT/ab_B.log"; } || status=1
  patch -p1 -R --silent < "$PATCH" || { echo "ab.sh: reverting the patch failed" >&2; exit 1; }
done
# AB_RESTORE=0 skips this last install (the tree's source is A again either way, the build stays B): in a device
# call whose copy is thrown away afterwards it only costs another build (~70 s on an H200 machine).
if [ "${AB_RESTORE:-1}" != "0" ]; then install A || status=1; fi
echo "ab.sh: logs in $OUT (ab_A.log, ab_B.log, ab_install.log)"
exit $status
