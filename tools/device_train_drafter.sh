#!/usr/bin/env bash
# On the GPU machine: train the EAGLE drafter for the default real model once, longer than a record's part 1 can,
# and return its weights to carry into later records (tools/device_rollout_record.sh's call 0). Two calls on one
# warm machine:
#   call 1, carry [.model/smollm2.part_00, .model/smollm2.sha256]:  bash tools/device_model.sh 1
#   call 2, carry [.model/smollm2.part_01, .whl, .peer/soz]:       bash tools/device_train_drafter.sh SECONDS SHA
# Call 2 joins the model, installs the package, and runs tlt_kernels.engine.train_drafter on 16 answers per train
# prompt for SECONDS of training (at most 360: the answers' rollouts and the heldout evaluation take the rest of the
# call's 600 s), then returns $OUT/eagle_bf16.pt (the drafter's weights, 8 MB), $OUT/train.log and
# $OUT/provenance.txt (the commit, the command and its summary line), and leaves the weights at /tmp/eagle.pt, where
# a record's part 1 in the same machine session finds them (tools/device_rollout_record.sh: it then trains none).
# Here, keep the three in .peer/eagle/ (ignored) for records in later sessions:
#   mkdir -p .peer/eagle && cp FILES_AT/{eagle_bf16.pt,train.log,provenance.txt} .peer/eagle/
set -uo pipefail
SECONDS_ARG=${1:-} SHA=${2:-}
[ -n "$SHA" ] && [ "$SECONDS_ARG" -ge 1 ] 2> /dev/null && [ "$SECONDS_ARG" -le 360 ] \
  || { echo "usage: bash tools/device_train_drafter.sh SECONDS(1-360) SHA" >&2; exit 64; }
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/device_train_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MODEL=/tmp/mcache/SmolLM2-135M-Instruct.Q4_1.gguf
bash tools/device_model.sh 2 > "$OUT/model.log" 2>&1 || { cat "$OUT/model.log"; exit 3; }
bash tools/device_install.sh "$OUT/install.log" || exit 4
CMD=(python3 -m tlt_kernels.engine.train_drafter --model-file "$MODEL" --out /tmp/eagle_trainer.pt
     --weights-out "$OUT/eagle_bf16.pt" --samples 16 --train-batch 16 --steps 100000 --train-seconds "$SECONDS_ARG" --eval)
timeout 590 "${CMD[@]}" > "$OUT/train.log" 2>&1
STATUS=$?
echo "train exit $STATUS"; tail -n 2 "$OUT/train.log"
{ echo "commit $SHA"; echo "command ${CMD[*]}"; tail -n 1 "$OUT/train.log"; } > "$OUT/provenance.txt"
# Left for a record in the same machine session: its part 1 then trains none (tools/device_rollout_record.sh).
[ $STATUS = 0 ] && cp "$OUT/eagle_bf16.pt" /tmp/eagle.pt && cp "$OUT/provenance.txt" /tmp/eagle_provenance.txt
exit $STATUS
