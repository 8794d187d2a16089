#!/usr/bin/env bash
# On the GPU machine (a copy of the tree, no .git, results under $OUT), from the repository root: install the package,
# optionally run GPU tests, and record one part of the tree-attention suite (docs/PERFORMANCE.md, "How to re-record"):
#   bash tools/device_record.sh --commit SHA [--part main|4096|16384|65536] [--tests "FILE ..."] [--test-timeout S]
#                               [--bench-timeout S]
# --part main replaces the run of record with the suite's main cases; --part L adds the long-tail cases at context L
# to the record in bench/results/h200/ (copy each returned $OUT/rec/h200/tree-attention.json there before the next
# part; all parts of one record at one commit). FlashInfer (the peer) comes from .peer/whl when carried
# (../shared/peers/README.md). tools/device_install.sh installs the package: the extension from a carried
# .peer/soz (tools/carry_extension.sh) or an earlier call on the warm machine when built from the same sources, else
# built there.
set -uo pipefail
COMMIT="" PART="" TESTS="" TEST_TIMEOUT=200 BENCH_TIMEOUT=540
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT=$2; shift 2 ;;
    --part) PART=$2; shift 2 ;;
    --tests) TESTS=$2; shift 2 ;;
    --test-timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --bench-timeout) BENCH_TIMEOUT=$2; shift 2 ;;
    *) echo "device_record.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$COMMIT" ] || { echo "device_record.sh: --commit SHA is required (the copy has no .git)" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/device_record_out}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONUNBUFFERED=1
export TLT_CUDA_ARCHS=90a TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16
t0=$SECONDS
if ls .peer/whl/*.whl > /dev/null 2>&1 && [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .peer/whl/*.whl > "$OUT/peer_install.log" 2>&1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
bash tools/device_install.sh "$OUT/install.log"
echo "setup $((SECONDS - t0)) s"
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086 # a list of files
  timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/pytest.log" 2>&1
  echo "pytest exit $? at $((SECONDS - t0)) s"; tail -5 "$OUT/pytest.log"
fi
if [ -n "$PART" ]; then
  mkdir -p "$OUT/rec/h200" "$OUT/w"
  if [ "$PART" = main ]; then
    ARGS=()
  else
    cp bench/results/h200/tree-attention.json "$OUT/rec/h200/"
    ARGS=(--cases "long-tail@$PART" --record-merge)
  fi
  timeout "$BENCH_TIMEOUT" python3 -m bench tree-attention "${ARGS[@]}" --record "$OUT/rec" --out "$OUT/w/ta" \
    --git-commit "$COMMIT" --progress > "$OUT/ta_$PART.log" 2>&1
  echo "bench exit $? at $((SECONDS - t0)) s"; tail -3 "$OUT/ta_$PART.log"
fi
