"""Repro: capture the fused step graphs of single static strategies with an fp32 target on the Triton tree attention.

In the 2026-11-26 08:43 e2e run (H200, TLT_E2E_ATTN=triton) `static-s6k4v24` alone failed to capture
(cudaErrorStreamCaptureInvalidated) while the selector's engine captured the same strategy. This script captures
each strategy in its own fresh engine (random weights, 2 layers) and prints the first failing op's traceback.
Usage (from the repository root): python -m bench.repro_capture [s6k4v24 s5k4v16 ...]
"""
import sys
import time
import traceback

import torch

from bench.suites.e2e import target_config
from tlt_kernels.drafter import EagleDrafter
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.models import LlamaForCausalLM
from tlt_kernels.runtime import GraphPool, Strategy
from tlt_kernels.runtime import graph_pool as gp


def main(names):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = target_config(512, 2)
    target = LlamaForCausalLM(cfg).to(dev).float().eval()
    orig = gp.GraphPool.capture

    def loud_capture(self, keys=None):
        try:
            return orig(self, keys)
        except Exception:
            traceback.print_exc()
            raise

    gp.GraphPool.capture = loud_capture
    for name in names:
        st = Strategy.parse(name)
        drafter = EagleDrafter.for_target(target, dtype=torch.bfloat16, seed=0).to(dev)
        eng = SpeculativeEngine(target, drafter, st, GraphPool(), max_batch_size=128, max_seq_len=1024, fuse_step=True,
                                backend="triton")
        t0 = time.perf_counter()
        stats = eng.capture_graphs([1, 2, 4, 8, 16, 32, 64, 128])
        print(f"{name}: {'FAILED ' + eng.graph_error if eng.graph_error else 'ok'} ({time.perf_counter() - t0:.1f}s) {stats.get('graphs')}",
              flush=True)
        del eng, drafter
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:] or ["s6k4v24", "s5k4v16", "s8k4v32"])
