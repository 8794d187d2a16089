"""Build script for tlt-kernels.

The package is pure Python (torch reference + Triton kernels) unless a CUDA compiler is present, in
which case CMake builds the optional extension ``tlt_kernels._C``: a pybind11 module over torch-free
CUDA code (raw device pointers as Python ints, no libtorch, cudart linked statically), so importing
it needs neither a GPU nor a matching torch C++ ABI.

Environment knobs:

* ``TLT_BUILD_CUDA``: ``0`` skips the extension; ``1`` forces it (fails if nvcc is missing); unset
  builds it when nvcc is found. When it is built and the build fails, the install fails.
* ``TLT_CUDA_ARCHS``: ``;``/``,``/space separated list such as ``90a`` or ``80;90a``. Default: the
  compute capability of the visible GPUs (``nvidia-smi``), else ``90a``.
* ``CUDA_HOME`` / ``CUDA_PATH`` / ``CUDACXX``: where to find nvcc.
* ``TLT_BUILD_JOBS``: parallel compile jobs (default: number of CPUs).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def read_version() -> str:
    text = (ROOT / "tlt_kernels" / "__init__.py").read_text()
    match = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not match:
        raise RuntimeError("tlt_kernels/__init__.py defines no __version__")
    return match.group(1)


def find_nvcc() -> str | None:
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    # Prefer the real toolkit over a wrapper script on PATH: CMake locates the toolkit from it.
    if Path("/usr/local/cuda/bin/nvcc").is_file():
        return "/usr/local/cuda/bin/nvcc"
    return shutil.which("nvcc")


def cuda_archs() -> list[str]:
    env = os.environ.get("TLT_CUDA_ARCHS", "").strip()
    if env:
        return [a for a in re.split(r"[;,\s]+", env) if a]
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        caps = sorted({line.strip().replace(".", "") for line in res.stdout.splitlines() if line.strip()})
    except (OSError, subprocess.SubprocessError):
        caps = []
    # sm_90 parts get the arch-specific target (Hopper features need 90a, which still runs on H100/H200).
    return [("90a" if c == "90" else c) for c in caps] or ["90a"]


def want_cuda() -> bool:
    flag = os.environ.get("TLT_BUILD_CUDA", "").strip()
    if flag == "0":
        return False
    if flag == "1":
        if find_nvcc() is None:
            raise RuntimeError("TLT_BUILD_CUDA=1 but nvcc was not found: put it on PATH or set CUDA_HOME")
        return True
    if flag:
        raise RuntimeError(f"TLT_BUILD_CUDA must be 0 or 1, got {flag!r}")
    return find_nvcc() is not None


class CMakeExtension(Extension):
    def __init__(self, name: str, source_dir: Path):
        super().__init__(name, sources=[])
        self.source_dir = str(source_dir)


class CMakeBuild(build_ext):
    """Configure + build one CMake target; the library lands where setuptools expects the extension
    (the build dir for wheels, the source tree for editable / ``--inplace`` builds)."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError("building tlt_kernels._C needs cmake >= 3.18 (pip install cmake), or set TLT_BUILD_CUDA=0")
        try:
            import pybind11
        except ImportError as exc:
            raise RuntimeError("building tlt_kernels._C needs pybind11 (pip install pybind11), or set TLT_BUILD_CUDA=0") from exc

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_temp = Path(self.build_temp).resolve() / "cmake"
        build_temp.mkdir(parents=True, exist_ok=True)
        archs = ";".join(cuda_archs())
        cfg = "Debug" if self.debug else "Release"
        args = [
            f"-S{ext.source_dir}",
            f"-B{build_temp}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
            f"-DTLT_CUDA_ARCHS={archs}",
            f"-DTLT_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ]
        if shutil.which("ninja"):
            args.append("-GNinja")
        print(f"tlt-kernels: building tlt_kernels._C for CUDA archs {archs}", flush=True)
        subprocess.run([cmake, *args], check=True)
        jobs = os.environ.get("TLT_BUILD_JOBS") or str(os.cpu_count() or 1)
        subprocess.run([cmake, "--build", str(build_temp), "--config", cfg, "-j", jobs], check=True)
        if not Path(self.get_ext_fullpath(ext.name)).exists():
            raise RuntimeError(f"CMake finished but {self.get_ext_fullpath(ext.name)} was not produced")


ext_modules = [CMakeExtension("tlt_kernels._C", ROOT)] if want_cuda() else []

setup(
    name="tlt-kernels",
    version=read_version(),
    description="CUDA/Triton kernels and a thin runtime for adaptive speculative decoding in RL rollouts",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["tlt_kernels*"]),
    # The tested range: the oldest pair is the GPU machine's (torch 2.11, Triton 3.6), CI runs the suite with Triton
    # 3.6 and again with the newest pair pip resolves inside this range (.ci/run). Widen it only after that passes.
    install_requires=["torch>=2.11,<2.15", 'triton>=3.6,<3.9; platform_system == "Linux"'],
    extras_require={"test": ["pytest", "pytest-benchmark", "scipy", "numpy", "hypothesis"],
                    # Real checkpoints: tokenizers, chat templates and GGUF dequantization through transformers.
                    "real": ["transformers", "gguf", "accelerate"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
