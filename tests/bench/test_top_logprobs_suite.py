"""The top-logprobs suite on a CPU: every case reports the op (its reference here) and torch's pipeline."""
import torch

from bench.harness import run_suite
from bench.suites import top_logprobs


def test_top_logprobs_suite_rows():
    res = run_suite("top-logprobs", top_logprobs.run, torch.device("cpu"), torch.bfloat16, small=True)
    assert res.status == "ok", res.data.get("error")
    rows = res.data["rows"]
    cases = {(r["case"]["rows"], r["case"]["V"], r["case"]["k"]) for r in rows}
    assert cases == {(rows, V, k) for rows, V, k, _ in top_logprobs._cases(on_gpu=False, small=True)}
    for case in cases:
        impls = {r["impl"] for r in rows if (r["case"]["rows"], r["case"]["V"], r["case"]["k"]) == case}
        assert impls == {"reference (stable sort)", "torch"}
    assert all(r["ms"] > 0 and r["bytes_moved"] > 0 for r in rows)


def test_gpu_cases_cover_the_draft_shapes():
    """The GPU cases: both vocabularies at every row count, k = 1, 4 and 8, bf16 and fp32 logits."""
    cases = top_logprobs._cases(on_gpu=True, small=False)
    assert {(rows, V) for rows, V, k, _ in cases if k == 4} >= {(r, V) for r in top_logprobs.GPU_ROWS
                                                                for V in top_logprobs.GPU_VOCABS}
    assert {k for _, _, k, _ in cases} == set(top_logprobs.KS)
    assert {dtype for *_, dtype in cases} == {torch.bfloat16, torch.float32}
