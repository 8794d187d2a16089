"""The block-verify suite on a CPU: every case reports both rules, block verification keeps at least as many drafts
(up to sampling noise), and the token rows' sampled mean matches their exact expectation."""
import torch

from bench.harness import run_suite
from bench.suites import block_verify


def test_block_verify_suite_rows():
    res = run_suite("block-verify", block_verify.run, torch.device("cpu"), torch.bfloat16, small=True)
    assert res.status == "ok", res.data.get("error")
    rows = res.data["rows"]
    cases = {(r["case"]["gamma"], r["case"]["accept"]) for r in rows}
    assert cases == {(g, b) for g in block_verify.GAMMAS for b in block_verify.LEVELS}
    by = {(r["case"]["gamma"], r["case"]["accept"], r["impl"]): r for r in rows}
    for gamma, beta in cases:
        token, block = by[gamma, beta, "token"], by[gamma, beta, "block"]
        assert abs(token["accept_rate"] - beta) < 0.03
        assert abs(token["mean_accepted"] - token["exact"]) < 0.2  # 2048 draws: standard error < 0.06
        assert block["mean_accepted"] >= token["mean_accepted"] - 0.1
