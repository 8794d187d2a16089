"""tlt_kernels._switches is the one module of the package that reads the environment, once, at import."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tlt_kernels"
# Not a switch: deterministic_training must set cuBLAS's variable (when unset) at the call, before cuBLAS's first use.
ALLOWED = {("models/train_tiny.py", 'os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")')}
_ENV_READ = re.compile(r"\bos\s*\.\s*(environ|getenv|putenv|unsetenv)\b|\bfrom\s+os\s+import\b.*\b(environ|getenv)\b")


def test_only_the_switches_module_reads_the_environment():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_switches.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _ENV_READ.search(line) and (rel, line.strip()) not in ALLOWED:
                found.append(f"tlt_kernels/{rel}:{n}: {line.strip()}")
    assert not found, "read the environment in tlt_kernels/_switches.py only:\n" + "\n".join(found)


def test_switch_get_raises_the_error_of_a_malformed_value():
    from tlt_kernels._switches import Switch

    assert Switch("X", 3).get() == 3
    with pytest.raises(ValueError, match="X must be 0 or 1, got 'yes'"):
        Switch("X", None, "X must be 0 or 1, got 'yes'").get()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_switches_are_read_at_import_and_a_bad_cuda_switch_spares_the_package_import():
    """The values reach the modules that use them; a malformed CUDA-only switch fails only the CUDA glue's import."""
    code = ("import tlt_kernels, tlt_kernels._backend as b, tlt_kernels._switches as s; "
            "print(b.DIRECT_DISPATCH, s.VERIFY_CLUSTER.value, s.VERIFY_TOPP_COMPACT.value, s.TREE_ATTENTION_CUDA_WS.error)")
    proc = _run(code, TLT_DIRECT_DISPATCH="0", TLT_VERIFY_CLUSTER="4", TLT_VERIFY_TOPP_COMPACT="0",
                TLT_TREE_ATTENTION_CUDA_WS="yes")
    assert proc.returncode == 0, proc.stderr[-500:]
    assert proc.stdout.strip() == "False 4 False TLT_TREE_ATTENTION_CUDA_WS must be 0 or 1, got 'yes'"
    proc = _run("import tlt_kernels._cuda.verify_tree as cv; print(cv.CLUSTER_SIZE, cv.TOPP_COMPACT, cv.PARALLEL_ROWS)",
                TLT_VERIFY_CLUSTER="2", TLT_VERIFY_TOPP_COMPACT="0", TLT_VERIFY_PARALLEL_ROWS="1")
    assert proc.returncode == 0 and proc.stdout.strip() == "2 False True", proc.stderr[-500:]
    proc = _run("import tlt_kernels._cuda.verify_tree as cv", TLT_VERIFY_PARALLEL_ROWS="sometimes")
    assert proc.returncode != 0 and "TLT_VERIFY_PARALLEL_ROWS must be auto, 0 or 1" in proc.stderr, proc.stderr[-500:]
