"""The linear suite on the CPU: every case has the three rows, timed per projection, with its bytes."""
import torch

from bench.harness import BenchContext
from bench.suites import linear


def test_cpu_run_has_every_row():
    ctx = BenchContext("linear", device="cpu")
    linear.run(ctx)
    rows = {(r.case["rows"], r.impl): r for r in ctx.rows}
    assert sorted(rows) == [(rows_, impl) for rows_ in (1, 4) for impl in ("cublas", "tlt-auto", "tlt-triton")]
    for (n, _), row in rows.items():
        assert row.ms > 0 and row.bytes_moved == (96 * 64 + n * (64 + 96)) * torch.bfloat16.itemsize
    assert any(f"chain of {linear.LAYERS}" in note for note in ctx.notes)
