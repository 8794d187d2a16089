"""Launches per drafted depth and per commit: the contract that keeps EAGLE's drafter fit for a small model's step.

On a small target a step is bound by its kernel launches, not by bytes (docs/MODELS.md), and each depth of an
EAGLE draft adds the drafter's layer, the vocabulary head, a top-k and the frontier's bookkeeping. The test counts
what a CUDA draft would launch on the fused path: every ATen op that is not a view (a view launches nothing), with
each of our ops (RMSNorm, rotary, SiLU * up, the attention run, bit packing, paged rows, the vocabulary's top-k, the
frontier step, the tree builder) counted once however its CPU reference computes it; an attention plan's launches (its
tables and scratch) are counted one by one, as a GPU makes them. GEMMs are left out
of the count: how torch splits a linear into ATen ops varies across versions, and a GEMM per projection is the
layer's work, not bookkeeping.
"""
import collections
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tlt_kernels.drafter.eagle as eagle_module
import tlt_kernels.drafter.eagle_fused as fused_module
import tlt_kernels.ops.build_draft_tree as tree_module
from tlt_kernels.drafter import DrafterKVCache, EagleDrafter
from tlt_kernels.models.config import ModelConfig
from tlt_kernels.models.llama import LlamaForCausalLM
from tlt_kernels.ops import tree_attention

# Non-GEMM launches at B = 3, measured with this file, newest first: per depth past the first (top-1 / top-4), a
# whole draft of depth 5 (top-1 / top-4; the constants of its shapes kept, tlt_kernels/drafter/constants.py) and a
# commit of 6 pairs. Bounds: one launch of slack for how a torch version splits an op.
#    9 / 10,    51 / 54, 24  the frontier step writes the kept children's ancestor words (no gather, no bitwise or)
#   11 / 12,    57 / 60, 24  RoPE's frequencies kept with both halves; the nodes' rows made step-major
#   11 / 12.3,  58 / 62, 25  each step's rotated queries land in a per-draft buffer (no cat); the roots' parents kept
#   12 / 13.3,  62 / 66, 25  a draft's plans share one zeroing of their arrival counters and take kept node counts
#   14 / 15.3,  70 / 74, 27  from here up a plan's own launches (its tables, its scratch) are counted one by one;
#                            below, a plan counted as one launch:
#   12 / 13.3,  63 / 67, 24  constants kept; RoPE's tables in fewer launches; the commit's updates in place
#   12 / 13.3,  71 / 75, 29  the residual add in the down projection's GEMM; the forest's mask words in place
#   15 / 16.3,  81 / 85, 35
#   23 / 25.3 before a step's candidates, next frontier and next inputs were one op (draft_frontier); 24 / 26.3 before
#   the vocabulary's log-softmax and top-k were one op (top_logprobs); 30 / 33.3 before the frontier's bookkeeping
#   was trimmed.
MAX_LAUNCHES_PER_DEPTH = {1: 10, 4: 11}
MAX_LAUNCHES_PER_DRAFT = {1: 52, 4: 55}
MAX_COMMIT_LAUNCHES = 25
GEMMS = {"aten.mm.default", "aten.addmm.default", "aten.addmm_.default", "aten.bmm.default", "aten.matmul.default",
         "aten.linear.default"}
OUR_OPS = {fused_module: ("rms_norm", "rotary_to_cache", "silu_and_mul", "pack_bit_words", "paged_rows"),
           eagle_module: ("rms_norm", "top_logprobs", "draft_frontier")}


class LaunchCounter(TorchDispatchMode):
    """Counts non-view, non-GEMM ATen ops; inside one of our ops (``inside`` > 0) nothing more is counted."""

    def __init__(self):
        super().__init__()
        self.launches = collections.Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside and str(func) not in GEMMS and not _is_view(func):
            self.launches[str(func)] += 1
        return out


# Ops that launch nothing although their schema is not a view: a reshape's re-view of a fresh result, allocations.
NO_LAUNCH = {"aten::_unsafe_view", "aten::empty", "aten::empty_like", "aten::empty_strided"}


def _is_view(func) -> bool:
    return func.is_view or func._schema.name in NO_LAUNCH


@pytest.fixture
def counter(monkeypatch):
    counter = LaunchCounter()

    def once(name, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            counter.launches[f"tlt.{name}"] += 1
            counter.inside += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.inside -= 1
        return counted

    for module, names in OUR_OPS.items():
        for name in names:
            monkeypatch.setattr(module, name, once(name, getattr(module, name)))
    monkeypatch.setattr(tree_module, "build_draft_tree", once("build_draft_tree", tree_module.build_draft_tree))
    monkeypatch.setattr(tree_attention.TreeAttentionPlan, "run",
                        once("TreeAttentionPlan.run", tree_attention.TreeAttentionPlan.run))
    return counter


def _drafter_with_context(B=3, L=29):
    torch.manual_seed(0)
    target = LlamaForCausalLM(ModelConfig.small(vocab_size=512, num_q_heads=6, num_kv_heads=2))
    drafter = EagleDrafter.for_target(target, seed=0, dtype=torch.float32).eval()
    drafter.pack_projections()
    cache = DrafterKVCache(drafter.config, 1 + 2 * B * drafter.blocks_per_request(L + 40, 16), 16)
    state = drafter.new_state(cache, B, L + 30)
    with torch.no_grad():
        drafter.extend(state, cache, torch.randn(B, L, drafter.config.hidden_size), torch.randint(0, 512, (B, L)),
                       torch.tensor([L, 17, 5], dtype=torch.int32), validate=False)
    return drafter, cache, state


def _count(counter, fn) -> int:
    """Non-GEMM launches of ``fn()`` once the constants of its shapes are cached (a first call makes them; a graph
    captured after a warm-up run reads them: tlt_kernels/drafter/constants.py)."""
    with torch.no_grad():
        fn()
    counter.launches.clear()
    with torch.no_grad(), counter:
        fn()
    return sum(counter.launches.values())


@pytest.mark.parametrize("draft_vocab", [False, True])
@pytest.mark.parametrize("topk", [1, 4])
def test_launches_per_drafted_depth(counter, topk, draft_vocab):
    """The same count with a draft vocabulary (the engines' default): its columns map to tokens inside the top-k."""
    drafter, cache, state = _drafter_with_context()
    if draft_vocab:
        drafter.set_draft_vocab(torch.arange(0, 512, 3))
    assert drafter._fused(cache, 4 * topk)  # the path a CUDA draft takes
    totals = {}
    for depth in (2, 5):
        totals[depth] = _count(counter, lambda: drafter.draft(state, cache, depth=depth, topk=topk,
                                                              num_verify=2 * depth))
        assert counter.launches["tlt.TreeAttentionPlan.run"] == depth - 1  # the count saw the draft's layers
    per_depth = (totals[5] - totals[2]) / 3
    assert per_depth <= MAX_LAUNCHES_PER_DEPTH[topk], (per_depth, dict(counter.launches))
    assert totals[5] <= MAX_LAUNCHES_PER_DRAFT[topk], (totals[5], dict(counter.launches))


def test_launches_per_commit(counter):
    drafter, cache, state = _drafter_with_context()
    B, n = 3, 6
    features, tokens = torch.randn(B, n, drafter.config.hidden_size), torch.randint(0, 512, (B, n))
    num_new = torch.full((B,), n, dtype=torch.int32)
    total = _count(counter, lambda: drafter.extend(state, cache, features, tokens, num_new, validate=False))
    assert counter.launches["tlt.TreeAttentionPlan.run"] == 1  # the fused path, which the count is about
    assert total <= MAX_COMMIT_LAUNCHES, (total, dict(counter.launches))
