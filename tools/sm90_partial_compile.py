"""The sm_90 compile of tree attention's Triton partial kernel, without a GPU: the script the Triton-variant tests
run (``tests/ops/test_tree_attention_triton_variants.py``, through ``conftest.compile_for_sm90``) and
``tools.triton_loop_sass`` uses, and the runner both call, kept here so both run the same compile."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Compiles the partial kernel for sm_90 (no GPU needed) with the config `kernel_config` picks, then runs ptxas;
# `{checks}` sees `c` (the compiled kernel), `regs`, `spills`, `smem` and the config's names.
PARTIAL_KERNEL_SM90 = r"""
import re
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tlt_kernels._triton import ptxas_report, tree_attention as m

D, T, G, FP32, KV, SPLIT = {D}, {T}, {G}, {fp32}, {kv!r}, {split}
CACHE_DTYPES = {{"*fp8e4nv": torch.float8_e4m3fn, "*fp8e5": torch.float8_e5m2}}  # else the rows' own dtype
block_m, chunks, block_n, warps, stages, maxnreg = m.kernel_config(D, T * G, fp32=FP32, e4m3_split_len=SPLIT)
k = m._tree_attn_partial_kernel
names = k.arg_names
ptrs = {{"BlockTable_ptr": "*i32", "ContextLens_ptr": "*i32", "NumNodes_ptr": "*i32", "TreeMask_ptr": "*i32",
        "PartialOut_ptr": "*fp32", "PartialLse_ptr": "*fp32", "Counters_ptr": "*i32"}}
consts = dict(NUM_KV_HEADS=4, T=T, G=G, W=-(-T // 32), HEAD_DIM=D, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n,
              BLOCK_T=max(16, 1 << (T - 1).bit_length()), NUM_M_CHUNKS=chunks, INTERPRET=False,
              DROP_BITS=0 if FP32 else 16, NUM_COUNTERS=-(-T * G // 16), FUSED_MERGE=block_m <= m.FUSED_MERGE_MAX_ROWS,
              MERGE_UNROLL=m.FUSED_MERGE_LOOP[0], MERGE_STAGES=m.FUSED_MERGE_LOOP[1], PIPELINE=1,
              LAZY_RESCALE=m.LAZY_RESCALE, DOT_PRECISION="ieee" if FP32 else "tf32",
              FP8_KEY_PRODUCTS=m.uses_fp8_key_products(torch.float32 if FP32 else torch.bfloat16, CACHE_DTYPES.get(KV),
                                                       D, block_m),
              HOIST_TREE=int(m.hoists_tree(max(16, 1 << (T - 1).bit_length()), block_m, D,
                                           CACHE_DTYPES.get(KV, torch.float32 if FP32 else torch.bfloat16))))
elem = "*fp32" if FP32 else "*bf16"
ptrs.update({{"K_ptr": KV, "V_ptr": KV}} if KV else {{}})
scales = ("qk_scale", "v_scale")
sig = {{n: "constexpr" if n in consts else ptrs.get(n, elem) if n.endswith("_ptr") else "fp32" if n in scales else "i32"
       for n in names}}
# What a launch specializes on: 16-byte aligned pointers, strides and split_len divisible by 16.
attrs = {{(names.index(n),): [["tt.divisibility", 16]] for n in names
         if sig[n] != "constexpr" and n not in (*scales, "stride_bt", "num_splits", "num_blocks")}}
src = ASTSource(k, sig, constexprs={{(names.index(c),): v for c, v in consts.items()}}, attrs=attrs)
opts = dict(num_warps=warps, num_stages=stages, **({{"maxnreg": maxnreg}} if maxnreg else {{}}))
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
regs, spills, log = ptxas_report(c.asm["ptx"])  # raises with ptxas's stderr if it fails
smem = c.metadata.shared
print(block_m, block_n, warps, stages, regs, spills, smem)
{checks}
"""


def run_sm90_script(script: str, timeout: float = 600) -> str:
    """Run ``script`` in a fresh interpreter from the repository root with ``TRITON_INTERPRET=0`` (the interpreter
    accepts code the compiler rejects) and return its stdout; raises RuntimeError with its stderr if it fails."""
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="0"), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return proc.stdout
