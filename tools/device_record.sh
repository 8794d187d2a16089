#!/usr/bin/env bash
# On the GPU machine (a copy of the tree, no .git, results under $OUT), from the repository root: install the package,
# optionally run GPU tests, and record parts of the tree-attention suite (docs/PERFORMANCE.md, "How to re-record"):
#   bash tools/device_record.sh --commit SHA [--part P]... [--continue] [--tests "FILE ..."] [--test-timeout S]
#                               [--bench-timeout S]
# Parts, in the order given, each a run of the suite on its cases:
#   main       the suite's named cases; replaces the run of record
#   main-7b    the named cases of the 7B model; replaces the run of record
#   main-32b   the named cases of the 32B model; added to the record (--record-merge)
#   4096, 16384, 65536   the long-tail cases at that context; added to the record
# A call that starts with an adding part adds to bench/results/CARD/tree-attention.json as carried (CARD the machine's
# card, h100 or h200: copy each returned $OUT/rec/CARD/tree-attention.json there before the next call; all parts of
# one record at one commit), or with
# --continue to the record the previous call left on the machine (/tmp/device_record_keep; the next call can then start
# at once, while the machine is still warm, about 30 s after a call). Every part
# must end within --bench-timeout seconds of the call's start (default 570). FlashInfer (the peer) comes from
# .peer/whl when carried (../shared/peers/README.md). tools/device_install.sh installs the package: the extension from
# a carried .peer/soz (tools/carry_extension.sh) or an earlier call on the warm machine when built from the same
# sources, else built there.
set -uo pipefail
COMMIT="" PARTS=() TESTS="" TEST_TIMEOUT=200 BENCH_TIMEOUT=570 CONTINUE=0
KEEP=/tmp/device_record_keep
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT=$2; shift 2 ;;
    --part) PARTS+=("$2"); shift 2 ;;
    --continue) CONTINUE=1; shift ;;
    --tests) TESTS=$2; shift 2 ;;
    --test-timeout) TEST_TIMEOUT=$2; shift 2 ;;
    --bench-timeout) BENCH_TIMEOUT=$2; shift 2 ;;
    *) echo "device_record.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$COMMIT" ] || { echo "device_record.sh: --commit SHA is required (the copy has no .git)" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
named_cases() {  # the suite's named cases of the model tags given, as --cases takes them
  python3 -c 'import sys; from bench.suites.tree_attention import CASES
print(",".join(f"{tag}:{B}x{L}x{T}" for tag in sys.argv[1:] for B, L, T in CASES))' "$@"
}
part_args() {  # the bench arguments of part $1
  case "$1" in
    main) echo "--cases $(named_cases 7b 32b)" ;;
    main-7b) echo "--cases $(named_cases 7b)" ;;
    main-32b) echo "--cases $(named_cases 32b) --record-merge" ;;
    4096|16384|65536) echo "--cases long-tail@$1 --record-merge" ;;
  esac
}
KNOWN_PARTS=(main main-7b main-32b 4096 16384 65536)  # part_args' cases
for part in "${PARTS[@]}"; do  # every part known before anything is installed
  known=0
  for name in "${KNOWN_PARTS[@]}"; do [ "$part" = "$name" ] && known=1; done
  [ "$known" = 1 ] || { echo "device_record.sh: unknown part $part (one of: ${KNOWN_PARTS[*]})" >&2; exit 2; }
done
CARD=$(python3 -c 'import torch; from bench.records import card_slug
print(card_slug(torch.cuda.get_device_name() if torch.cuda.is_available() else None))')
FROM=bench/results/$CARD/tree-attention.json  # what an adding part adds to
if [ "$CONTINUE" = 1 ]; then
  FROM=$KEEP/tree-attention.json
  [ -f "$FROM" ] || { echo "device_record.sh: --continue: no record left by a previous call (the machine went cold)" >&2
                      exit 3; }
fi
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
mkdir -p "$OUT/rec/$CARD" "$OUT/w"
[ "${#PARTS[@]}" -gt 0 ] && [ -f "$FROM" ] && cp "$FROM" "$OUT/rec/$CARD/"
for part in "${PARTS[@]}"; do
  left=$((BENCH_TIMEOUT - (SECONDS - t0)))
  [ "$left" -gt 30 ] || { echo "part $part: no time left"; exit 5; }
  # shellcheck disable=SC2046 # the part's arguments, split on purpose
  timeout "$left" python3 -m bench tree-attention $(part_args "$part") --record "$OUT/rec" --out "$OUT/w/ta_$part" \
    --git-commit "$COMMIT" --progress > "$OUT/ta_$part.log" 2>&1
  code=$?
  echo "part $part: bench exit $code at $((SECONDS - t0)) s"; tail -3 "$OUT/ta_$part.log"
  [ "$code" = 0 ] || exit 6  # a later part would add to a record this one did not finish
  mkdir -p "$KEEP" && cp "$OUT/rec/$CARD/tree-attention.json" "$KEEP/"  # for a --continue call
done
