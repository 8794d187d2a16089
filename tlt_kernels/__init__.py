"""tlt-kernels: kernels and a thin runtime for adaptive speculative decoding in RL rollouts.

Public ops (each has a pure-torch reference in :mod:`tlt_kernels.reference` and fast backends
behind ``backend="auto"``):

* :func:`tree_attention` -- attention of draft-tree nodes over a paged KV cache plus their ancestors;
* :func:`verify_tree` -- lossless acceptance of a draft tree from the target's logits;
* :func:`verify_chain_block` -- block verification of draft chains (lossless, accepts at least as many drafts);
* :func:`compact_kv` -- move the accepted path's K/V to contiguous cache slots;
* :func:`build_draft_tree` -- EAGLE-2-style selection of the nodes to verify;
* :func:`draft_frontier` -- one EAGLE-2 draft step's candidates, next frontier and next inputs in one launch;
* :func:`ngram_propose` / :func:`ngram_propose_tree` -- model-free drafts from each request's own history;
* :func:`philox_uniform` -- the walks' counter-based random stream (:mod:`tlt_kernels.rng`) as a tensor;
* :func:`top_logprobs` -- the k most likely tokens of each row of logits with their log-probabilities (a draft's
  expansion);
* :func:`rms_norm`, :func:`silu_and_mul`, :func:`apply_rotary` -- fused elementwise parts of a Llama layer
  (RMSNorm with residual add, SiLU-and-multiply, rotate-half RoPE of q and k; :func:`rotary_to_cache` also stores
  the rotated k and v at their KV-cache rows).

Layers above the ops (each imports the ops, never the reverse): :mod:`tlt_kernels.runtime`
(strategy selector, CUDA-graph pool), :mod:`tlt_kernels.models` (Llama/Qwen2-style target over a
paged cache), :mod:`tlt_kernels.drafter` (n-gram and EAGLE drafters, spot trainer) and
:mod:`tlt_kernels.engine` (the speculative rollout engine).

Importing this package never imports Triton or the CUDA extension and never queries a GPU.
"""
from ._backend import BACKENDS, BackendUnavailableError, available_backends, cuda_extension_available
from .ops.build_draft_tree import DraftTree, build_draft_tree
from .ops.compact_kv import compact_kv
from .ops.draft_frontier import FrontierStep, draft_frontier
from .ops.ngram import NGramDrafts, NGramTree, ngram_propose, ngram_propose_tree
from .ops.philox_uniform import philox_uniform
from .ops.rms_norm import rms_norm
from .ops.rotary import apply_rotary, rotary_to_cache
from .ops.silu_and_mul import silu_and_mul
from .ops.top_logprobs import top_logprobs
from .ops.tree_attention import TreeAttentionPlan, plan_masked_attention, plan_tree_attention, tree_attention
from .ops.verify_chain_block import BlockVerifyResult, verify_chain_block
from .ops.verify_tree import VerifyResult, verify_tree
from .tree import (
    chain_parents,
    pack_tree_mask,
    tree_ancestor_mask,
    tree_ancestor_mask_packed,
    tree_depths,
    tree_positions,
    unpack_tree_mask,
    validate_tree,
)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "BlockVerifyResult",
    "DraftTree",
    "FrontierStep",
    "NGramDrafts",
    "NGramTree",
    "TreeAttentionPlan",
    "VerifyResult",
    "apply_rotary",
    "rotary_to_cache",
    "available_backends",
    "build_draft_tree",
    "chain_parents",
    "compact_kv",
    "draft_frontier",
    "cuda_extension_available",
    "ngram_propose",
    "ngram_propose_tree",
    "plan_masked_attention",
    "plan_tree_attention",
    "pack_tree_mask",
    "philox_uniform",
    "rms_norm",
    "silu_and_mul",
    "top_logprobs",
    "tree_ancestor_mask",
    "tree_ancestor_mask_packed",
    "tree_attention",
    "tree_depths",
    "tree_positions",
    "unpack_tree_mask",
    "validate_tree",
    "verify_chain_block",
    "verify_tree",
]
