#!/usr/bin/env bash
# Builds and runs tools/ws_probe.cu on the GPU machine: bash tools/ws_probe.sh [B] [T] [L,...] [variant] (variant: the
# build mode 3 stamps, 0 as shipped or 4 the TMA build). Each mode is one build
# (WS_PROBE_MODES, default "0 1 2 3"): 0 the kernel as shipped (its TMA build and the lockstep one beside it), 1
# streaming only, 2 math only, 3 checkpoints inside the kernel (where a CTA's time goes). Needs nvcc; writes nothing
# outside /tmp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODES=${WS_PROBE_MODES:-0 1 2 3}
for mode in $MODES; do
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc -DTLT_WS_PROBE=$mode \
    tools/ws_probe.cu csrc/tree_attention/tree_attention_ctx_sm90.cu csrc/tree_attention/tree_attention.cu -o /tmp/ws_probe_$mode &
done
wait
for mode in $MODES; do /tmp/ws_probe_$mode "${1:-64}" "${2:-16}" "${3:-1024,4096,16384}" "${4:-0}"; done
