"""The optional CUDA extension: the package works without it, and it is torch-free when built."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _extension_path():
    import tlt_kernels

    pkg = Path(tlt_kernels.__file__).parent
    found = sorted(pkg.glob("_C*.so")) + sorted(pkg.glob("_C*.pyd"))
    return found[0] if found else None


def _ext_or_skip():
    try:
        from tlt_kernels import _C
    except ImportError as exc:
        pytest.skip(f"tlt_kernels._C is not built ({exc})")
    return _C


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )


def test_package_works_without_extension():
    """With _C unimportable, the package imports, reports why 'cuda' is unavailable, and runs on torch."""
    code = (
        "import sys\n"
        "sys.modules['tlt_kernels._C'] = None  # makes 'import tlt_kernels._C' raise ImportError\n"
        "import torch, tlt_kernels\n"
        "from tlt_kernels import _backend\n"
        "assert not tlt_kernels.cuda_extension_available()\n"
        "why = _backend.backend_unavailable_reason('cuda', torch.device('cuda'))\n"
        "assert 'tlt_kernels._C is not built' in why and 'TLT_BUILD_CUDA=1' in why, why\n"
        "from tlt_kernels._cuda import extension\n"
        "try:\n"
        "    extension()\n"
        "except ImportError as e:\n"
        "    assert 'not available' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('extension() should raise')\n"
        "print('ok')\n"
    )
    res = _run_python(code)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_setup_metadata_without_cuda_build():
    res = subprocess.run(
        [sys.executable, "setup.py", "--name", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TLT_BUILD_CUDA": "0"},
    )
    assert res.returncode == 0, res.stderr
    import tlt_kernels

    assert res.stdout.split() == ["tlt-kernels", tlt_kernels.__version__]


def test_setup_rejects_bad_build_flag():
    res = subprocess.run(
        [sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "TLT_BUILD_CUDA": "yes"},
    )
    assert res.returncode != 0
    assert "TLT_BUILD_CUDA must be 0 or 1, got 'yes'" in res.stderr


def test_extension_build_info():
    ext = _ext_or_skip()
    info = ext.build_info()
    assert set(info) >= {"archs", "nvcc_version", "cuda_runtime_compiled", "cuda_runtime_version", "cuda_driver_version"}
    assert re.fullmatch(r"[0-9a-z]+( [0-9a-z]+)*", info["archs"]), info
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", info["nvcc_version"]), info
    assert info["cuda_runtime_compiled"] >= 11000 and info["cuda_runtime_version"] >= 11000, info
    assert tuple(info["head_dims"]) == (64, 128, 256)
    from tlt_kernels._cuda import build_info

    assert build_info() == dict(info)


def test_extension_is_torch_free():
    """_C must not link libtorch / c10 (torch C++ ABI) nor need libcudart.so (static runtime)."""
    _ext_or_skip()
    so = _extension_path()
    assert so is not None
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf is not installed")
    dyn = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    assert needed, dyn
    bad = [n for n in needed if re.match(r"lib(torch|c10|cudart)", n)]
    assert not bad, f"_C links {bad}; needed = {needed}"


def test_extension_validates_arguments_before_touching_the_gpu():
    """Bad sizes raise ValueError naming the argument (no CUDA call happens, so this runs on CPU)."""
    ext = _ext_or_skip()
    args = dict(
        q=0, k_cache=0, v_cache=0, block_table=0, context_lens=0, num_nodes=0, tree_mask=0, partial_out=0,
        partial_lse=0, out=0, q_strides=(0, 0, 0), k_strides=(0, 0, 0), v_strides=(0, 0, 0), out_strides=(0, 0, 0),
        bt_stride_b=0, batch=1, num_tree=1, num_q_heads=4, num_kv_heads=1, head_dim=96, block_size=16,
        num_splits=1, split_len=256, sm_scale=0.1, dtype=ext.DTYPE_BFLOAT16, stream=0,
    )
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256 for the CUDA backend, got 96"):
        ext.tree_attention_partial(**args)
    with pytest.raises(ValueError, match=r"num_q_heads \(6\) must equal num_kv_heads \(4\) \* group \(1\)"):
        ext.tree_attention_merge(**{**args, "head_dim": 128, "num_q_heads": 6, "num_kv_heads": 4})
    with pytest.raises(ValueError, match="q_strides must be a 3-tuple"):
        ext.tree_attention_merge(**{**args, "q_strides": (1, 2)})
    ok = {**args, "head_dim": 128}
    with pytest.raises(ValueError, match="kv_fp8 code must be 0"):
        ext.tree_attention_partial(**{**ok, "kv_fp8": 3})
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="v_scale must be a finite number > 0"):
            ext.tree_attention_merge(**{**ok, "v_scale": bad})


_CUDA_GLUE = "import tlt_kernels._cuda.tree_attention as ct; "


def _assert_switch_parsed(show: str, name: str, cases, error: str) -> None:
    """Each (value, expected) of environment variable `name` makes `show` print `expected` at import of the CUDA glue
    module; the value "yes" fails the import with "`name` `error`"."""
    for value, expected in cases:
        proc = _run_python(_CUDA_GLUE + show, **{name: value})
        assert proc.returncode == 0 and proc.stdout.strip() == expected, (value, proc.stdout, proc.stderr[-500:])
    proc = _run_python(_CUDA_GLUE + show, **{name: "yes"})
    assert proc.returncode != 0 and f"{name} {error}" in proc.stderr, proc.stderr[-500:]


def test_cuda_context_path_switch_is_parsed():
    """TLT_TREE_ATTENTION_CUDA_CTX: unset/auto = the T*G > 64 rule (None), 1 = on, 0 = off, anything else a clear error."""
    _assert_switch_parsed("print(ct.CONTEXT_SM90)", "TLT_TREE_ATTENTION_CUDA_CTX",
                          (("auto", "None"), ("1", "True"), ("0", "False")), "must be auto, 0 or 1")


def test_cuda_warp_specialized_switch_is_parsed():
    """TLT_TREE_ATTENTION_CUDA_WS: unset/empty/1 = the warp-specialized build of the 128-token kernel, 0 = the lockstep one,
    anything else a clear error; the launch config carries the choice (the tile width, ORed with the flag)."""
    _assert_switch_parsed("print(ct.CONTEXT_WARP_SPECIALIZED, ct.context_config(112), ct.context_config(56))",
                          "TLT_TREE_ATTENTION_CUDA_WS",
                          (("", "True 1152 64"), ("1", "True 1152 64"), ("0", "False 128 64")), "must be 0 or 1")


def test_cuda_tma_switch_is_parsed():
    """TLT_TREE_ATTENTION_CUDA_TMA: unset/auto = TMA copies for wide trees (T*G > 128) and, on cards with fast memory,
    wherever the warp-specialized kernel runs; 1 = wherever it runs, 0 = never, anything else a clear error; the
    launch config carries it (| 2048)."""
    show = ("print(ct.CONTEXT_TMA, ct.context_config(112), ct.context_config(448), ct.context_config(56), "
            "ct.context_config(112, fast_memory=True), ct.context_config(56, fast_memory=True))")
    _assert_switch_parsed(show, "TLT_TREE_ATTENTION_CUDA_TMA",
                          (("auto", "None 1152 3200 64 3200 64"), ("1", "True 3200 3200 64 3200 64"),
                           ("0", "False 1152 1152 64 1152 64")),
                          "must be auto, 0 or 1")
    # TMA is a build of the warp-specialized kernel: no TMA flag without it.
    proc = _run_python(_CUDA_GLUE + show, TLT_TREE_ATTENTION_CUDA_TMA="1", TLT_TREE_ATTENTION_CUDA_WS="0")
    assert proc.returncode == 0 and proc.stdout.strip() == "True 128 128 64 128 64", proc.stdout


def test_fast_memory_threshold_lies_between_the_measured_cards():
    """The auto TMA rule's bandwidth threshold separates the H100 SXM (TMA measured -2.0% to +0.6% at T=16) from the
    H200 (+1.3% to +12.4%): the driver's peak bandwidths (2 x memory clock x bus width) were 3352.32 GB/s on an H100
    and 4814.30 GB/s on two H200s (the run log: docs/PERFORMANCE.md, Earlier runs, 2026-11-27 03:33-04:13)."""
    from tlt_kernels._cuda import tree_attention as ct

    assert 3352.32 < ct.TMA_MIN_BANDWIDTH_GBPS < 4814.30


def test_cuda_context_path_rule(monkeypatch):
    """Where the CUDA backend takes the sm_90 kernel (CPU: the device query is stubbed). auto: any T*G (over 128
    rows only the warp-specialized build, in 128-row blocks), D=128,
    bf16/fp16, split_len a multiple of the tile (128 tokens above 64 rows, 64 for the one-warpgroup kernel),
    power-of-two pages of contiguous token rows, sm_90; 1 / 0 force it on / off within what the kernel covers."""
    from types import SimpleNamespace

    import tlt_kernels._cuda.tree_attention as ct

    cc = {"major": 9}
    monkeypatch.setattr(ct, "cuda_capability", lambda device: (cc["major"], 0))

    def plan(T=16, G=7, D=128, splits=1, split_len=4096, block_size=16):
        return SimpleNamespace(num_tree=T, group=G, head_dim=D, num_splits=splits, split_len=split_len,
                               block_size=block_size)

    q = torch.empty(0, dtype=torch.bfloat16)
    cache = torch.empty(4, 16, 2, 128, dtype=torch.bfloat16)
    kv = (cache, cache)
    monkeypatch.setattr(ct, "CONTEXT_SM90", None)
    assert ct._use_context_sm90(plan(), q, *kv)                           # T=16, G=7: 112 rows
    assert ct._use_context_sm90(plan(T=13, G=5), q, *kv)                  # 65 rows
    assert ct._use_context_sm90(plan(T=16, G=4), q, *kv)                  # 64 rows: the one-warpgroup kernel
    assert ct._use_context_sm90(plan(T=8, G=7, split_len=4160), q, *kv)   # ... whose tile is 64 tokens
    assert ct.context_tile(64) == 64 and ct.context_tile(65) == 128
    assert ct._use_context_sm90(plan(splits=2, split_len=2048), q, *kv)   # several splits (the merge follows)
    assert not ct._use_context_sm90(plan(split_len=4160), q, *kv)         # not whole 128-token tiles
    assert not ct._use_context_sm90(plan(D=64), q, *kv)
    assert ct._use_context_sm90(plan(T=32), q, *kv)                       # 224 rows: two warp-specialized CTAs
    assert ct._use_context_sm90(plan(T=64, G=8), q, *kv)                  # 512 rows: four
    assert not ct._use_context_sm90(plan(), q.float(), *kv)
    assert not ct._use_context_sm90(plan(block_size=24), q, *kv)          # pages: a power of two ...
    heads_major = torch.empty(4, 2, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert not ct._use_context_sm90(plan(), q, heads_major, cache)        # ... of contiguous token rows
    cc["major"] = 8
    assert not ct._use_context_sm90(plan(), q, *kv)                       # wgmma: sm_90 only
    cc["major"] = 9
    fp8 = cache.to(torch.float8_e4m3fn)
    assert ct._use_context_sm90(plan(), q, fp8, fp8)                      # fp8 caches: the same kernels ...
    ws = 128 | ct.WARP_SPECIALIZED_FLAG
    assert ct.context_config(112, fast_memory=True, fp8=True) == ws       # ... without the TMA flag
    assert ct.context_config(448, fp8=True) == ws
    assert ct.context_config(56, fp8=True) == 64
    assert ct._use_context_sm90(plan(T=32), q, fp8, fp8)                  # 224 rows: two warp-specialized CTAs
    padded = torch.empty(4, 16, 2, 136, dtype=torch.float8_e4m3fn)[..., :128]  # head stride 136: not 16-byte rows
    assert not ct._use_context_sm90(plan(), q, padded, padded)
    monkeypatch.setattr(ct, "CONTEXT_SM90", True)
    assert ct._use_context_sm90(plan(T=8, G=7, splits=3, split_len=1024), q, *kv)
    assert ct._use_context_sm90(plan(T=32), q, *kv)
    monkeypatch.setattr(ct, "CONTEXT_WARP_SPECIALIZED", False)           # the lockstep kernels: 128 rows at most
    assert not ct._use_context_sm90(plan(T=32), q, *kv)
    assert ct._use_context_sm90(plan(), q, *kv)
    monkeypatch.setattr(ct, "CONTEXT_WARP_SPECIALIZED", True)
    monkeypatch.setattr(ct, "CONTEXT_SM90", False)
    assert not ct._use_context_sm90(plan(), q, *kv)


def test_forced_context_path_restores_the_rule():
    """forced_context_path sets CONTEXT_SM90 inside its block and restores it after, also when the block raises."""
    import tlt_kernels._cuda.tree_attention as ct

    before = ct.CONTEXT_SM90
    for value in (True, False, None):
        with ct.forced_context_path(value):
            assert ct.CONTEXT_SM90 is value
        assert ct.CONTEXT_SM90 is before
    with pytest.raises(RuntimeError, match="inside"):
        with ct.forced_context_path(not before):
            raise RuntimeError("inside")
    assert ct.CONTEXT_SM90 is before


def test_forced_switches_set_several_and_refuse_unknown_names():
    """forced_switches sets each CONTEXT_ switch it is given and restores all of them; an unknown name raises before
    any switch changes."""
    import tlt_kernels._cuda.tree_attention as ct

    before = (ct.CONTEXT_WARP_SPECIALIZED, ct.CONTEXT_TMA)
    with ct.forced_switches(WARP_SPECIALIZED=not before[0], TMA=True):
        assert (ct.CONTEXT_WARP_SPECIALIZED, ct.CONTEXT_TMA) == (not before[0], True)
    assert (ct.CONTEXT_WARP_SPECIALIZED, ct.CONTEXT_TMA) == before
    with pytest.raises(AttributeError, match="CONTEXT_NO_SUCH"):
        with ct.forced_switches(TMA=not before[1], NO_SUCH=1):
            pass
    assert (ct.CONTEXT_WARP_SPECIALIZED, ct.CONTEXT_TMA) == before


def test_tree_attention_launch_args_fit_the_binding():
    """The host wrapper's keyword arguments are exactly the binding's (CPU tensors: only pointers and sizes are read;
    the binding then refuses head_dim 96 before any CUDA call). Catches a renamed or undefined argument on CPU."""
    ext = _ext_or_skip()
    from tlt_kernels._cuda.tree_attention import _launch_args
    from tlt_kernels.ops.tree_attention import plan_tree_attention

    B, T, Hkv, G, D, page = 3, 5, 2, 3, 128, 16
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * B, dtype=torch.int32)
    table = torch.arange(B * 4, dtype=torch.int32).view(B, 4)
    plan = plan_tree_attention(parents, [17, 0, 40], table, num_q_heads=Hkv * G, num_kv_heads=Hkv, head_dim=D,
                               block_size=page)
    q = torch.zeros(B, T, Hkv * G, D, dtype=torch.bfloat16)
    kv = torch.zeros(B * 4, page, Hkv, D, dtype=torch.bfloat16)
    args = _launch_args(plan, q, kv, kv, q, 0.1)
    assert args["batch"] == B and args["num_tree"] == T and args["num_q_heads"] == Hkv * G
    assert args["q"] == q.data_ptr() and args["block_table"] == plan.block_table.data_ptr()
    with pytest.raises(ValueError, match="head_dim must be 64, 128 or 256"):
        ext.tree_attention_partial(**{**args, "head_dim": 96, "stream": 0})
    assert args["kv_fp8"] == ext.KV_FP8_NONE and args["v_scale"] == 1.0
    for dtype, code in ((torch.float8_e4m3fn, ext.KV_FP8_E4M3), (torch.float8_e5m2, ext.KV_FP8_E5M2)):
        fp8 = kv.to(dtype)
        assert _launch_args(plan, q, fp8, fp8, q, 0.1, 0.5)["kv_fp8"] == code  # the glue's codes are the binding's
        assert _launch_args(plan, q, fp8, fp8, q, 0.1, 0.5)["v_scale"] == 0.5


@pytest.mark.cuda
def test_gpu_smoke():
    """One tiny tree-attention call through the CUDA backend matches the reference."""
    _ext_or_skip()
    from tlt_kernels.ops.tree_attention import plan_tree_attention
    from tlt_kernels.reference.tree_attention import tree_attention_reference

    g = torch.Generator().manual_seed(0)
    B, T, Hkv, G, D, bs = 2, 4, 2, 2, 128, 16
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([20, 0], dtype=torch.int32, device="cuda")
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32, device="cuda")
    k = torch.randn(4, bs, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    v = torch.randn(4, bs, Hkv, D, generator=g).to(torch.bfloat16).cuda()
    q = torch.randn(B, T, Hkv * G, D, generator=g).to(torch.bfloat16).cuda()
    plan = plan_tree_attention(parents, ctx, table, num_q_heads=Hkv * G, num_kv_heads=Hkv, head_dim=D, block_size=bs)
    out = plan.run(q, k, v, backend="cuda")
    ref = tree_attention_reference(q, k, v, table, ctx, parents, out_dtype=torch.float32)
    torch.cuda.synchronize()
    print(f"gpu smoke: max_abs_err={float((out.float() - ref).abs().max()):.3g} build_info={_ext_or_skip().build_info()}")
    torch.testing.assert_close(out.float(), ref, atol=2.5e-2, rtol=2e-2)


def test_cuda_errors_become_runtime_errors():
    """TLT_CUDA_CHECK failures surface as RuntimeError with CUDA's error name, the expression and file:line."""
    ext = _ext_or_skip()
    with pytest.raises(RuntimeError, match=r"CUDA error cudaErrorInvalidValue \(1\): invalid argument\n  in .+\n  at .*bindings\.cpp:\d+"):
        ext._cuda_check_selftest(1)
    ext._cuda_check_selftest(0)  # cudaSuccess: no exception


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgmma_building_blocks_match_torch(dtype):
    """csrc/tree_attention/wgmma_sm90.cuh on one tile: 128-byte-swizzled staging, K-major and MN-major descriptors, the
    accumulator -> A-fragment mapping and both instruction wrappers, against torch (S = A B^T, O = P V with P = S
    rounded). The kernel also redoes both products with the 128-token tile's blocks (m64n128k16_ss, 128-row descriptors, the
    float[64] A fragment) on mirrored 128-row operands and marks every element they disagree on with +inf."""
    ext = _ext_or_skip()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    g = torch.Generator().manual_seed(0)
    a, b, v = (torch.randn(64, 128, generator=g).to(dtype).cuda() for _ in range(3))
    s = torch.full((64, 64), float("nan"), device="cuda")
    o = torch.full((64, 128), float("nan"), device="cuda")
    code = ext.DTYPE_BFLOAT16 if dtype == torch.bfloat16 else ext.DTYPE_FLOAT16
    ext._wgmma_selftest(a.data_ptr(), b.data_ptr(), v.data_ptr(), s.data_ptr(), o.data_ptr(), code,
                        torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    # +inf marks where the 128-wide blocks disagree with the 64-wide ones: the 64-wide ones against torch first.
    ref_s = a.float() @ b.float().T
    inf_s, inf_o = torch.isposinf(s), torch.isposinf(o)
    torch.testing.assert_close(s[~inf_s], ref_s[~inf_s], atol=1e-3, rtol=1e-4)
    p = torch.where(inf_s, ref_s, s).to(dtype).float()
    torch.testing.assert_close(o[~inf_o], (p @ v.float())[~inf_o], atol=1e-2, rtol=1e-3)
    assert not inf_s.any() and not inf_o.any(), (
        f"the 128-wide blocks disagree with the 64-wide ones on {int(inf_s.sum())} of 4096 S elements "
        f"(mma_m64n128k16_ss, desc_k_major over 128 rows; first [row, col] {inf_s.nonzero()[:6].tolist()}) and "
        f"{int(inf_o.sum())} of 8192 O elements (float[64] a_fragment, desc_mn_major over 128 rows; first "
        f"{inf_o.nonzero()[:6].tolist()})")


def test_wgmma_selftest_rejects_bad_arguments():
    ext = _ext_or_skip()
    with pytest.raises(ValueError, match="must be device pointers"):
        ext._wgmma_selftest(0, 0, 0, 0, 0, 1, 0)
    with pytest.raises(ValueError, match="dtype must be 0"):
        ext._wgmma_selftest(8, 8, 8, 8, 8, 7, 0)


def _ptxas_verbose_sm90(name: str, cubin: str = os.devnull):
    """Compile csrc/<name> for sm_90a with ``ptxas -v`` into ``cubin``; the finished process (its stderr holds the
    report). Skips without nvcc."""
    import shutil
    import subprocess

    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = os.path.join(ROOT, "csrc", name)
    proc = subprocess.run([nvcc, "-cubin", src, "-o", cubin, "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17",
                           "--expt-relaxed-constexpr", "-O3", "-Xptxas=-v", "-I", os.path.join(ROOT, "csrc")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_sm90_kernel_compiles_without_wgmma_serialization():
    """csrc/tree_attention/tree_attention_ctx_sm90.cu: ptxas keeps its wgmmas asynchronous (no C7514, which serializes
    every wgmma of the kernel when an accumulator is read while in flight) and spills nothing."""
    proc = _ptxas_verbose_sm90("tree_attention/tree_attention_ctx_sm90.cu")
    assert "C7514" not in proc.stderr, proc.stderr
    assert " 0 bytes spill stores" in proc.stderr and "bytes spill stores" in proc.stderr
    assert all(" 0 bytes spill stores" in line for line in proc.stderr.splitlines() if "spill stores" in line), proc.stderr
    # Both instantiations (two warpgroups, 128-token tiles: the default; one warpgroup per 64-row chunk, 64-token
    # tiles: config 64), each for fp16 and bf16 queries over caches of their dtype, e4m3 and e5m2.
    entries = [line for line in proc.stderr.splitlines() if "Compiling entry function" in line]
    assert len(entries) == 12, proc.stderr
    for cfg in ("CtxConfigILi128ELi2EEE", "CtxConfigILi64ELi1EEE"):
        assert sum(cfg in line for line in entries) == 6, (cfg, entries)


def test_sm90_warp_specialized_kernel_compiles_without_serialization_or_spills():
    """csrc/tree_attention/tree_attention_ctx_sm90_ws.cu: no C7514 (serialized wgmmas), and the builds the backend
    launches keep their registers: the default (Q in registers, 3 K + 4 V stages, cp.async) and the fp8 build (2 K +
    3 V stages, 2 staged tiles; its producer widens within its 56 registers) spill nothing; the TMA build keeps its
    small producer spill (16 bytes at 56 registers, measured faster anyway) from growing."""
    import re

    proc = _ptxas_verbose_sm90("tree_attention/tree_attention_ctx_sm90_ws.cu")
    assert "C7514" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    spills = {}
    for i, line in enumerate(lines):
        if "Compiling entry function" in line:
            cfg = re.search(r"WsConfigILb(\d)ELi(\d)ELi(\d)ELb(\d)E|WsFp8ConfigILi(\d)ELi(\d)ELi(\d)E", line).groups()
            cfg = tuple(c for c in cfg if c is not None) if cfg[0] else ("fp8",) + cfg[4:]
            spill = next(l for l in lines[i + 1:] if "spill stores" in l)
            spills.setdefault(cfg, []).append(int(re.search(r"(\d+) bytes spill stores", spill).group(1)))
    # fp16 and bf16 of: the default, K4+V3, Q in shared memory, TMA; the fp8 build for both and e4m3 / e5m2
    assert set(spills) == {("1", "3", "4", "0"), ("1", "4", "3", "0"), ("0", "3", "3", "0"), ("1", "3", "4", "1"),
                           ("fp8", "2", "3", "2")}, spills
    assert [len(v) for v in spills.values()] == [4 if cfg[0] == "fp8" else 2 for cfg in spills], spills
    assert spills[("1", "3", "4", "0")] == [0, 0], spills
    assert spills[("fp8", "2", "3", "2")] == [0, 0, 0, 0], spills
    assert max(spills[("1", "3", "4", "1")]) <= 16, spills


def _elf_section_sizes(path: str) -> dict:
    """``{section name: size in bytes}`` of an ELF64 file (a cubin), read from its section headers."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b"\x7fELF" and data[4] == 2, f"{path} is not an ELF64 file"
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):  # (name, type, flags, addr, offset, size, link, info, addralign, entsize)
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = header(shstrndx)[4]
    sizes = {}
    for i in range(shnum):
        h = header(i)
        start = names + h[0]
        sizes[data[start:data.index(b"\0", start)].decode()] = h[5]
    return sizes


@pytest.mark.parametrize("tu", ["verify_tree_bf16.cu", "verify_tree_bf16_scored.cu"])
def test_verify_tree_kernels_do_not_spill(tmp_path, tu):
    """csrc/verify_tree/verify_tree_bf16.cu (bf16 logits, every draft-probability type, with and without the top-p candidate
    path) and its scored twin (the same walk also writing log-probs): no verify_tree instantiation spills at the
    128-register cap of two 256-thread CTAs per SM. Before 30a178f a top-p-free batch ran the spilling candidate
    instantiation (ncu: 177,024 local-memory requests in one chain4 B=16 call; the run log: docs/PERFORMANCE.md,
    Earlier runs, 2026-11-26).

    And the row visit is inlined once: with two call sites (the root and each accepted node) every instantiation was
    ~1.7x larger (342-360 KB of SASS, 547-560 KB with the candidate path) and top-p walks 3-10% slower (H200,
    same-run A/B, the run log: docs/PERFORMANCE.md, Earlier runs, 2026-11-26 22:45)."""
    cubin = str(tmp_path / "verify_bf16.cubin")
    proc = _ptxas_verbose_sm90(f"verify_tree/{tu}", cubin)
    lines = proc.stderr.splitlines()
    entries = [i for i, line in enumerate(lines) if "Compiling entry function" in line and "verify_tree_kernel" in line]
    assert len(entries) == 6, proc.stderr[-3000:]
    for i in entries:
        spill = next(line for line in lines[i + 1:] if "spill stores" in line)
        assert " 0 bytes spill stores, 0 bytes spill loads" in spill, (lines[i], spill)
    text = {k: v for k, v in _elf_section_sizes(cubin).items() if k.startswith(".text.") and "verify_tree_kernel" in k}
    assert len(text) == 6, text
    for name, size in text.items():
        # verify_tree_kernel<TL, TQ, HAS_Q, SCORED, TOPP_COMPACT>
        scored = re.search(r"Lb[01]ELb([01])ELb[01]EEEvNS_16VerifyTreeParamsEi$", name).group(1)
        assert scored == ("1" if tu.endswith("_scored.cu") else "0"), name
        candidates = name.endswith("Lb1EEEvNS_16VerifyTreeParamsEi")  # TOPP_COMPACT = true
        assert size <= (352 if candidates else 256) * 1024, (name, size)
