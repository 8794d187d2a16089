#!/usr/bin/env bash
# On the GPU machine: rebuild the GGUF that tools/carry_model.sh split, in two calls on the same warm machine (it
# stays warm about 30 s after a call; /tmp survives while it does):
#   call 1, carry [".model/smollm2.part_00", ".model/smollm2.sha256"]:  bash tools/device_model.sh 1
#   call 2, carry [".model/smollm2.part_01", ".whl"]:                    bash tools/device_model.sh 2 && <your job>
# Call 2 joins the pieces into /tmp/mcache/SmolLM2-135M-Instruct.Q4_1.gguf (pass it as --model-file), checks its
# sha256 against call 1's, and installs the carried .whl/*.whl (gguf, accelerate) without dependencies.
# Later calls on the same warm machine may call `device_model.sh 2` again without carrying anything: the model
# joined by call 2 is kept (its sha256 checked then) and reused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MCACHE=/tmp/mcache
MODEL=$MCACHE/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$MCACHE"
case "${1:-}" in
  1) cp .model/smollm2.part_00 .model/smollm2.sha256 "$MCACHE/"; echo "device_model.sh: part 1 in $MCACHE" ;;
  2)
    [ -f "$MCACHE/smollm2.part_00" ] || { echo "device_model.sh: part 1 is gone (the machine went cold): run call 1 again" >&2; exit 2; }
    # A later call on the same warm machine finds the model joined (and the wheels installed) by an earlier one,
    # so it need not carry part_01 and .whl again.
    if [ -f "$MCACHE/joined" ] && [ "$(cat "$MCACHE/joined")" = "$(cat "$MCACHE/smollm2.sha256")" ]; then
      echo "device_model.sh: $MODEL ready (joined by an earlier call)"; exit 0
    fi
    cat "$MCACHE/smollm2.part_00" .model/smollm2.part_01 > "$MODEL"
    [ "$(sha256sum "$MODEL" | cut -d' ' -f1)" = "$(cat "$MCACHE/smollm2.sha256")" ] \
      || { echo "device_model.sh: sha256 of the joined model differs from the local copy's" >&2; exit 3; }
    python3 -m pip install -q --no-index --no-deps .whl/*.whl
    cp "$MCACHE/smollm2.sha256" "$MCACHE/joined"
    echo "device_model.sh: $MODEL ready" ;;
  *) echo "usage: bash tools/device_model.sh 1|2" >&2; exit 64 ;;
esac
