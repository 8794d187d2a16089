"""The README's Performance table: which rows of which records each line summarizes, and how.

Each :class:`Headline` names a suite, one of our impls and the cases it covers; its cell for a card is the
**median** of ``column`` over those rows of that card's record (one number per cell: a representative, not a
range; docs/PERFORMANCE.md has every row). The ratio column is the median of ``ratio`` over the same rows of the
H200 record (the H100's where the H200 has none): our impl against the peer measured in the same run.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

Row = Dict[str, Any]

CARDS = ("h100", "h200")  # the README's columns, in order
RATIO_CARDS = ("h200", "h100")  # whose ratio the ratio column shows: the first card with one


@dataclass(frozen=True)
class Headline:
    """One line of the README table.

    Args:
        label: the op or workload, with the peer the ratio is taken against.
        metric: what the card columns hold.
        suite: the record's suite.
        impl: our impl whose rows are summarized.
        where: which rows (flat: case parameters beside the columns) of that impl count.
        column: the row column summarized in the card cells.
        scale: multiplies the column (e.g. 1000 for ms -> us).
        fmt: format of a card cell.
        ratio: the row's ratio to the peer (None: no ratio for this line).
        selection: the rows in words, for docs/PERFORMANCE.md.
    """

    label: str
    metric: str
    suite: str
    impl: str
    where: Callable[[Row], bool]
    column: str
    selection: str
    scale: float = 1.0
    fmt: str = "{:.1f}"
    ratio: Optional[Callable[[Row], Optional[float]]] = None

    def rows(self, flat_rows: List[Row]) -> List[Row]:
        return [r for r in flat_rows if r.get("impl") == self.impl and self.where(r) and r.get(self.column) is not None]

    def value(self, flat_rows: List[Row]) -> Optional[float]:
        values = [float(r[self.column]) * self.scale for r in self.rows(flat_rows)]
        return statistics.median(values) if values else None

    def ratio_value(self, flat_rows: List[Row]) -> Optional[float]:
        if self.ratio is None:
            return None
        ratios = [x for x in (self.ratio(r) for r in self.rows(flat_rows)) if x is not None]
        return statistics.median(ratios) if ratios else None


def _vs(peer: str) -> Callable[[Row], Optional[float]]:
    """ms(peer) / ms(ours) in the same case: > 1 means ours is faster."""
    return lambda row: (row.get("speedup_vs") or {}).get(peer)


def _column(name: str) -> Callable[[Row], Optional[float]]:
    return lambda row: row.get(name)


def _tree(T: int, long_context: bool) -> Callable[[Row], bool]:
    """The main (byte-bound, many-request) cases at ``T``: B >= 32, so the long-tail cases (B <= 16) count apart."""
    return lambda r: r.get("T") == T and r.get("B", 0) >= 32 and (not long_context or r.get("L", 0) >= 2048)


def _long_tail(r: Row) -> bool:
    """The suite's long-tail cases (``--long-tail``): B <= 16 requests, T in {1, 4, 8}, L >= 4096."""
    return r.get("B", 0) <= 16 and r.get("T") in (1, 4, 8) and r.get("L", 0) >= 4096


def _chains(V: int) -> Callable[[Row], bool]:
    """Chain cases at vocabulary ``V`` with bf16 logits (records before --logits-dtypes hold bf16 only)."""
    return lambda r: str(r.get("shape", "")).startswith("chain") and r.get("V") == V and r.get("logits", "bf16") == "bf16"


def _b128(r: Row) -> bool:
    return r.get("B") == 128


def _ngram_256x8k(r: Row) -> bool:
    return r.get("B") == 256 and r.get("L") == 8192 and r.get("k") == 8 and r.get("branches") in (None, "")


def _rl_step(r: Row) -> bool:
    return r.get("step") not in (None, "all")


def _uniform(batch: int) -> Callable[[Row], bool]:
    """The greedy uniform workload at ``batch`` (a sampled row's case carries its temperature)."""
    return lambda r: r.get("workload") == "uniform" and r.get("B") == batch and not r.get("temperature")


HEADLINES: List[Headline] = [
    Headline("`tree_attention` Triton, T = 8, B >= 32, L >= 2048 (vs FlashInfer custom-mask prefill)", "% of the HBM floor",
             "tree-attention", "tlt-triton", _tree(8, True), "pct_hbm_floor", "T = 8 cases with B >= 32 and L >= 2048",
             ratio=_vs("flashinfer")),
    Headline("`tree_attention` CUDA, T = 8, B >= 32, L >= 2048 (vs FlashInfer)", "% of the HBM floor",
             "tree-attention", "tlt-cuda", _tree(8, True), "pct_hbm_floor", "T = 8 cases with B >= 32 and L >= 2048",
             ratio=_vs("flashinfer")),
    Headline("`tree_attention` Triton, T = 16, B >= 32 (vs FlashInfer)", "% of the HBM floor",
             "tree-attention", "tlt-triton", _tree(16, False), "pct_hbm_floor", "T = 16 cases with B >= 32",
             ratio=_vs("flashinfer")),
    Headline("`tree_attention` CUDA, T = 16, B >= 32 (vs FlashInfer)", "% of the HBM floor",
             "tree-attention", "tlt-cuda", _tree(16, False), "pct_hbm_floor", "T = 16 cases with B >= 32",
             ratio=_vs("flashinfer")),
    Headline("`tree_attention` Triton, long tail: B <= 16, T = 1/4/8, L 4k-64k (vs FlashInfer XQA)",
             "% of the HBM floor", "tree-attention", "tlt-triton", _long_tail, "pct_hbm_floor",
             "the long-tail cases (B <= 16, T in 1/4/8, L >= 4096)", ratio=_vs("flashinfer-xqa")),
    Headline("`verify_tree` chains, V = 152064, graph-replayed (vs FlashInfer's sampling pipeline, graph-replayed)",
             "time, us", "acceptance", "tlt-cuda-graph", _chains(152064), "ms", "chain cases at V = 152064",
             scale=1000.0, ratio=_vs("flashinfer-graph")),
    Headline("`verify_tree` chains, V = 32000, graph-replayed (vs the same)", "time, us",
             "acceptance", "tlt-cuda-graph", _chains(32000), "ms", "chain cases at V = 32000",
             scale=1000.0, ratio=_vs("flashinfer-graph")),
    Headline("`ngram_propose`, 256 histories of 8k tokens, graph-replayed (vs the torch reference)", "time, us",
             "ngram", "tlt-triton-graph", _ngram_256x8k, "ms", "B = 256, L = 8192, k = 8 (random and repetitive)",
             scale=1000.0, ratio=_vs("torch-ref")),
    Headline("rollout of SmolLM2-135M-Instruct, B = 1, plain decoding (vs transformers `generate` with a static cache "
             "and its compiled decode step)", "tokens/s", "rollout", "plain", _uniform(1), "tokens_per_s",
             "the uniform B = 1 `plain` row", fmt="{:.0f}", ratio=_vs("hf-static-compiled")),
    Headline("the same, B = 64", "tokens/s", "rollout", "plain", _uniform(64), "tokens_per_s",
             "the uniform B = 64 `plain` row", fmt="{:.0f}", ratio=_vs("hf-static-compiled")),
    Headline("GRPO on SmolLM2-135M-Instruct (8 problems x G = 8, T = 1), plain decoding (vs transformers `generate`)",
             "rollout s per RL step", "rl", "plain", _rl_step, "rollout_s", "the `plain` rows of the steps",
             fmt="{:.2f}", ratio=_vs("hf")),
    Headline("e2e rollout, B = 128, adaptive engine (vs the best static strategy as deployed)",
             "speed-up over plain decoding", "e2e", "adaptive", _b128, "speedup_vs_plain",
             "the `adaptive` row", fmt="{:.2f}x", ratio=_column("speedup_vs_best_static")),
    Headline("e2e, the tail (batch < B/4), adaptive engine", "speed-up over plain decoding", "e2e", "adaptive",
             _b128, "tail_speedup_vs_plain", "the `adaptive` row", fmt="{:.2f}x"),
]
