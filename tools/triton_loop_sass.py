"""What tree attention's Triton context loop issues per trip, without a GPU: the partial kernel compiled for sm_90
(``tools.sm90_partial_compile``, the Triton-variant tests' compile, with the configuration the library picks), its
cubin disassembled with Triton's bundled ``nvdisasm``, and the instructions of its longest loop (the backward branch
with the most instructions between its label and itself) counted by opcode.

    python -m tools.triton_loop_sass [--cases "KV,T,SPLIT;..."] [--D 128] [--G 7] [--top 12]

KV is ``e4m3``, ``e5m2`` or ``bf16`` (the caches' storage; the rows are bf16), SPLIT the plan's split length (it picks
the 128-key tiles of long e4m3 splits) or 0 for none. Prints one JSON line per case: the row tile, keys a trip,
registers and spills, the loop's instruction count and its most frequent opcodes (docs/TREE_ATTENTION.md, "Split
choice", has a table of them)."""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

from tools.sm90_partial_compile import PARTIAL_KERNEL_SM90, run_sm90_script

CASES = "e4m3,1,4096;e4m3,4,4096;e4m3,8,4096;bf16,1,0;bf16,4,0;bf16,8,0"
KV_TYPES = {"e4m3": "*fp8e4nv", "e5m2": "*fp8e5", "bf16": None}
# An instruction line: its address comment, an optional predicate (@P0, @!UP1), then the opcode.
_OPCODE = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_WRITE_CUBIN = 'open({path!r}, "wb").write(c.asm["cubin"])'


def compile_cubin(D: int, T: int, G: int, kv: str, split: int, path: str) -> dict:
    """Compile the partial kernel for sm_90 into ``path`` (a cubin); returns its configuration and ptxas's report."""
    script = PARTIAL_KERNEL_SM90.format(D=D, T=T, G=G, fp32=False, kv=KV_TYPES[kv], split=split or None,
                                        checks=_WRITE_CUBIN.format(path=path))
    fields = run_sm90_script(script).split()[-7:]  # the script's last print: the config and ptxas's report
    names = ("block_m", "block_n", "warps", "stages", "registers", "spill_bytes", "shared_bytes")
    return dict(zip(names, (int(x) for x in fields)))


def disassemble(cubin: str) -> str:
    """The cubin's SASS, from the ``nvdisasm`` Triton ships for its NVIDIA backend."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "nvdisasm")
    return subprocess.run([tool, "-c", cubin], capture_output=True, text=True, check=True).stdout


def longest_loop(sass: str) -> collections.Counter:
    """Opcode counts of the longest loop of ``sass``: the instructions from a label to a later branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    best = collections.Counter()
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = collections.Counter(op.group(1) for body in lines[labels[m.group(1)]:i + 1]
                                      if (op := _OPCODE.search(body)))
            if sum(ops.values()) > sum(best.values()):
                best = ops
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=CASES, help="cases as KV,T,SPLIT;... (KV: e4m3, e5m2 or bf16)")
    parser.add_argument("--D", type=int, default=128, help="head dim")
    parser.add_argument("--G", type=int, default=7, help="query heads per KV head")
    parser.add_argument("--top", type=int, default=12, help="opcodes to print per case")
    args = parser.parse_args(argv)
    cases = [case.split(",") for case in args.cases.split(";")]
    for case in cases:  # every case checked before the first compile
        if len(case) != 3 or case[0] not in KV_TYPES or not (case[1].isdigit() and case[2].isdigit()):
            raise SystemExit(f"--cases: {','.join(case)!r} is not KV,T,SPLIT with KV one of {sorted(KV_TYPES)}")
    with tempfile.TemporaryDirectory() as tmp:
        for kv, T, split in cases:
            cubin = os.path.join(tmp, "partial.cubin")
            config = compile_cubin(args.D, int(T), args.G, kv, int(split), cubin)
            ops = longest_loop(disassemble(cubin))
            print(json.dumps(dict(kv=kv, T=int(T), split=int(split), **config, loop_instructions=sum(ops.values()),
                                  opcodes=dict(ops.most_common(args.top)))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
