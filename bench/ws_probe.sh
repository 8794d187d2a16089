#!/usr/bin/env bash
# Builds and runs bench/ws_probe.cu three ways (the shipped kernel + the lockstep one, streaming only, math only) on
# the GPU machine: bash bench/ws_probe.sh [B] [T] [L,...]. Needs nvcc; writes nothing outside /tmp.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for mode in 0 1 2; do
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc -DTLT_WS_PROBE=$mode \
    bench/ws_probe.cu csrc/tree_attention_ctx_sm90.cu csrc/tree_attention.cu -o /tmp/ws_probe_$mode &
done
wait
for mode in 0 1 2; do /tmp/ws_probe_$mode "${1:-64}" "${2:-16}" "${3:-1024,4096,16384}"; done
