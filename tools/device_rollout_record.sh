#!/usr/bin/env bash
# On the GPU machine, from the repository root: the rollout suite's run of record on the real default model, in four
# parts, in the device calls below (the machine stays warm between calls; /tmp survives while it does):
#   call 0 (optional), carry [.peer/eagle]:                          bash tools/device_rollout_record.sh drafter
#   call 1, carry [.model/smollm2.part_00, .model/smollm2.sha256]:  bash tools/device_model.sh 1
#   call 2, carry [.model/smollm2.part_01, .whl, .peer/soz]:       bash tools/device_rollout_record.sh 1 SHA
#   calls 3, 4 and 5, carry [.peer/soz]:                             bash tools/device_rollout_record.sh 2|3|4 SHA
# After tools/device_train_drafter.sh in the same machine session (it joined the model), call 2 carries [.peer/soz]
# only: the joined model and the trained drafter are found in /tmp.
# Call 0 puts a drafter trained earlier (tools/device_train_drafter.sh: .peer/eagle/eagle_bf16.pt and its
# provenance.txt; no room for it beside the model's pieces in calls 1 and 2) at /tmp/eagle.pt, where
# tools/device_train_drafter.sh also leaves the drafter it trained earlier in the same machine session. Part 1 joins
# the model (tools/device_model.sh 2), installs the package (tools/device_install.sh; .peer/soz from
# tools/carry_extension.sh saves the build), trains the EAGLE drafter when none was carried
# (tlt_kernels.engine.train_drafter for TRAIN_SECONDS, default 60; its log in $OUT/train.log, its weights and
# provenance in $OUT/eagle/, to keep in .peer/eagle/ for later sessions; a carried one's provenance goes to
# $OUT/provenance.txt) and records B = 1 and 4 with the step-cost rows; part 2 adds B = 16 and the 64-request tail,
# part 3 B = 64 and 256 (--record-merge; parts 2 and 3 measure the step-cost rows at B = 1 again, the suite needs one
# size); part 4 the sampled rows (--temperature 1: B = 1, 16 and the tail, our engines only, no step-cost rows). Each
# part returns the merged record as $OUT/rec/rollout.json (copy the last to bench/results/h200/, add the drafter's
# training figures to its notes, then `python -m bench report`). Three parts (B = 1, 4 and the tail in the first)
# overran a call's 600 s once the drafter's training took 150 s and the transformers rows ran slower.
# GPU_TESTS="FILES..." (e.g. in part 4, the shortest) also runs those test files after the bench, in the call's time
# left: $OUT/gpu_tests.log. ARMS=LIST replaces the static arms (default s2k1v3,s4k1v5,s5k4v16; every part of one record
# takes the same). FORECAST=1 adds the budgeted selectors' forecast rows (--selector-forecast: `<drafter>
# adaptive [budget 0.02, forecast]`, cold and warm), four more rows per workload: give a part the time for them.
set -uo pipefail
PART=${1:-} SHA=${2:-}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ "$PART" = drafter ]; then
  [ -f .peer/eagle/eagle_bf16.pt ] || { echo "no .peer/eagle/eagle_bf16.pt carried" >&2; exit 3; }
  cp .peer/eagle/eagle_bf16.pt /tmp/eagle.pt && cp .peer/eagle/provenance.txt /tmp/eagle_provenance.txt
  echo "drafter at /tmp/eagle.pt:"; cat /tmp/eagle_provenance.txt; exit 0
fi
[ -n "$SHA" ] && [ "$PART" = 1 -o "$PART" = 2 -o "$PART" = 3 -o "$PART" = 4 ] \
  || { echo "usage: bash tools/device_rollout_record.sh drafter | 1|2|3|4 SHA" >&2; exit 64; }
OUT=${OUT:-/tmp/device_rollout_out}
export PYTHONUNBUFFERED=1
T0=$SECONDS
MODEL=/tmp/mcache/SmolLM2-135M-Instruct.Q4_1.gguf
# Every adaptive engine also runs with a 2% loss budget (its rows "[budget 0.02]"): what decides that default.
COMMON=(--model-file $MODEL --max-new-tokens 128 --arms "${ARMS:-s2k1v3,s4k1v5,s5k4v16}"
        --eagle-checkpoint /tmp/eagle.pt --selector-loss-budget none,0.02 --split heldout --progress --git-commit "$SHA")
[ "${FORECAST:-0}" = 1 ] && COMMON+=(--selector-forecast)
mkdir -p "$OUT/rec" /tmp/rollout_rec
if [ "$PART" = 1 ]; then
  bash tools/device_model.sh 2 > "$OUT/model.log" 2>&1 || { cat "$OUT/model.log"; exit 3; }
  bash tools/device_install.sh "$OUT/install.log" || exit 4
  if [ -f /tmp/eagle_provenance.txt ]; then
    cp /tmp/eagle_provenance.txt "$OUT/provenance.txt"; echo "carried drafter:"; cat "$OUT/provenance.txt"
  else
    TRAIN=(python3 -m tlt_kernels.engine.train_drafter --model-file $MODEL --out /tmp/eagle.pt
           --weights-out "$OUT/eagle/eagle_bf16.pt" --steps 100000 --train-seconds "${TRAIN_SECONDS:-60}" --eval)
    mkdir -p "$OUT/eagle"
    timeout $((110 + ${TRAIN_SECONDS:-60})) "${TRAIN[@]}" > "$OUT/train.log" 2>&1
    echo "train exit $? at $((SECONDS - T0)) s"; tail -1 "$OUT/train.log"
    { echo "commit $SHA"; echo "command ${TRAIN[*]}"; tail -n 1 "$OUT/train.log"; } > "$OUT/eagle/provenance.txt"
    cp "$OUT/train.log" "$OUT/eagle/"
  fi
  rm -rf /tmp/rollout_rec/*
  timeout $((570 - (SECONDS - T0))) python3 -m bench rollout "${COMMON[@]}" --batches 1,4 --tail-batch 0 \
    --step-batches 1,32 --record /tmp/rollout_rec --out "$OUT/w" > "$OUT/rollout_1.log" 2>&1
else
  ls /tmp/rollout_rec/*/rollout.json > /dev/null 2>&1 && [ -f /tmp/eagle.pt ] \
    || { echo "part 1 is gone (the machine went cold)" >&2; exit 3; }
  bash tools/device_install.sh "$OUT/install.log" || exit 4
  if [ "$PART" = 2 ]; then
    PART_ARGS=(--batches 16 --tail-batch 64 --step-batches 1)
  elif [ "$PART" = 3 ]; then
    PART_ARGS=(--batches 64,256 --tail-batch 0 --step-batches 1)
  else
    PART_ARGS=(--temperature 1 --batches 1,16 --tail-batch 64 --no-hf-eager --no-hf-compile)
  fi
  timeout $((570 - (SECONDS - T0))) python3 -m bench rollout "${COMMON[@]}" "${PART_ARGS[@]}" \
    --record /tmp/rollout_rec --record-merge --out "$OUT/w$PART" > "$OUT/rollout_$PART.log" 2>&1
fi
echo "bench exit $? at $((SECONDS - T0)) s"; tail -4 "$OUT/rollout_$PART.log"
cp /tmp/rollout_rec/*/rollout.json "$OUT/rec/" 2> /dev/null
if [ -n "${GPU_TESTS:-}" ]; then  # GPU tests riding in a part with time to spare (gpu_tests.json rows, by hand)
  LEFT=$((585 - (SECONDS - T0)))
  if [ $LEFT -lt 30 ]; then  # timeout refuses a negative limit; a few seconds test nothing
    echo "GPU_TESTS skipped: $LEFT s left in the call"
  else
    timeout $LEFT python3 -m pytest -q -p no:cacheprovider $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
    echo "pytest exit $? at $((SECONDS - T0)) s"; tail -3 "$OUT/gpu_tests.log"
  fi
fi
