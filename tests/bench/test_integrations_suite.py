"""The integrations suite (``python -m bench integrations``) on the CPU: every adapter and the direct walk get a row
per case (FlashInfer's own call and the -graph rows need a GPU)."""
import json

from bench.__main__ import main


def test_small_run_times_every_adapter_and_the_walk(tmp_path):
    assert main(["integrations", "--small", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "integrations.json").read_text())["rows"]
    impls = {"verify_tree", "flashinfer-adapter", "vllm-adapter", "sglang-adapter"}
    cases = {json.dumps(r["case"], sort_keys=True) for r in rows}
    assert len(cases) == 2 and {r["impl"] for r in rows} == impls
    assert all(r["ms"] > 0 and r["bytes_moved"] > 0 for r in rows)
