"""Triton kernels. Imported lazily by the backend tables; nothing here runs at package import."""
from __future__ import annotations

from typing import Tuple


def ptxas_report(ptx: str, gpu: str = "sm_90a") -> Tuple[int, int, str]:
    """Assemble compiled PTX with ``ptxas -v`` (no GPU needed): ``(registers, spill-store bytes, ptxas log)`` of its
    first kernel. Raises RuntimeError with ptxas's stderr when it fails. For compile-only checks (tests, benches)."""
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(d + "/k.ptx", "w") as f:
            f.write(ptx)
        r = subprocess.run(["ptxas", "-v", "--gpu-name", gpu, d + "/k.ptx", "-o", d + "/k.o"], capture_output=True,
                           text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    regs = int(re.search(r"Used (\d+) registers", r.stderr).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))
    return regs, spills, r.stderr
