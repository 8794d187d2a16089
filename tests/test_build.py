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

ROOT = Path(__file__).resolve().parents[1]


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
    """The auto TMA rule's bandwidth threshold separates the H100 SXM (TMA measured -2.0% to +0.6% at T=16; 2619 MHz
    x 5120 bits, 3352 GB/s) from the H200 (+1.3% to +12.4%; the driver reported 4814 GB/s, bench/RESULTS.md
    2026-11-27 03:42)."""
    from tlt_kernels._cuda import tree_attention as ct

    h100_sxm_gbps = 2 * 2619e6 * 5120 / 8 / 1e9
    assert h100_sxm_gbps < ct.TMA_MIN_BANDWIDTH_GBPS < 4814.3
