"""The EAGLE drafter as a rollout :class:`~tlt_kernels.drafter.base.Drafter`: its paged KV cache, its per-request
state and the graphs of its tree draft and KV extension.

Graph inputs are the state rows (block_table, context_lens, last_hidden, root_tokens), plus (features,
next_tokens, num_new) for extend. Padded rows point at the drafter cache's write-sink block 0 with zero context and
num_new = 0, so they read garbage nobody uses and write only the sink.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._validation import devices_equal
from .base import DrafterBase, ProposedTree
from .eagle import DrafterKVCache, EagleDrafter, EagleState

# EagleState's fields, in the order the drafter graphs take them.
EAGLE_FIELDS = ("block_table", "context_lens", "last_hidden", "root_tokens")


def eagle_tree_width(strategy) -> int:
    """``num_verify`` nodes (EAGLE-2 selection keeps exactly that many); plain decoding: 1."""
    return 1 if strategy.is_off else strategy.num_verify


class EagleRolloutDrafter(DrafterBase):
    """Drives an :class:`~tlt_kernels.drafter.EagleDrafter` (``module``) over a rollout."""

    fused_step_error = None
    lazy_commit = True  # the extension takes any number of pairs per request (0 included)

    def __init__(self, model: EagleDrafter, device: torch.device):
        model_device = next(model.parameters()).device
        if not devices_equal(model_device, device):
            raise ValueError(f"the EagleDrafter is on {model_device} but the target is on {device}; move it with .to()")
        self.module = model
        self.device = device
        self.cache: Optional[DrafterKVCache] = None
        self.state: Optional[EagleState] = None
        self.slots_per_request = None
        self.vocab_version = model.draft_vocab_version

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype

    def tree_width(self, strategy) -> int:
        return eagle_tree_width(strategy)

    def bind(self, *, strategies, fuse_step, device, max_batch_size, slots_per_request, block_size) -> None:
        blocks_per_request = self.module.blocks_per_request(slots_per_request, block_size)
        self.slots_per_request = slots_per_request
        self.cache = DrafterKVCache(self.module.config, 1 + max_batch_size * blocks_per_request, block_size,
                                    device=device, dtype=self.dtype)
        self.module.pack_projections()  # one GEMM for q/k/v and one for gate/up in every draft and commit
        self.vocab_version = self.module.draft_vocab_version  # what the graphs captured after this will draft from

    # -- a rollout ----------------------------------------------------------------------------------
    def start(self, prompts, prompt_lens, first_tokens, prefill_hidden, graphs=None, bucket=None) -> None:
        """The prompts' pairs ``(f_i, t_{i+1})``, the last one's token the first sampled; with ``graphs`` and the
        prefill's ``bucket``, from graph ``("start", bucket)`` (:meth:`prefill_graph_specs`), the prompts padded to
        the bucket (pairs past a prompt are not cached: ``num_new`` is its length)."""
        if self.module.draft_vocab_version != self.vocab_version:
            raise RuntimeError("the EagleDrafter's draft vocabulary changed after the engine was built (its captured "
                               "graphs draft from the old one): call set_draft_vocab before building the engine")
        B, L = prompts.shape
        self.state = self.module.new_state(self.cache, B, self.slots_per_request)
        if graphs is None or bucket is None:
            new_state = self._start_fn(self.state.block_table, prompts, prompt_lens, first_tokens, prefill_hidden)
        else:
            if bucket > L:
                prompts, prefill_hidden = F.pad(prompts, (0, bucket - L)), F.pad(prefill_hidden, (0, 0, 0, bucket - L))
            inputs = [self.state.block_table, prompts, prompt_lens, first_tokens, prefill_hidden]
            new_state, _ = graphs.call(("start", bucket), self._start_fn, inputs, B)
        for f, value in zip(EAGLE_FIELDS[1:], new_state):
            getattr(self.state, f).copy_(value)

    def prefill_graph_specs(self, lengths):
        """Graph ``("start", L)`` per prompt bucket ``L`` (eagerly, a rollout's start is dozens of small launches)."""
        return [(("start", length), self._start_fn, lambda p, length=length: self._start_padding(p, length))
                for length in lengths]

    def state_rows(self, rows):
        return [getattr(self.state, f)[rows] for f in EAGLE_FIELDS]

    def propose(self, strategy, rows, state_rows, graphs) -> ProposedTree:
        outs, _ = graphs.call(self._draft_key(strategy), self._draft_fn(strategy), state_rows, rows.shape[0])
        return ProposedTree(*outs)

    def commit(self, rows, state_rows, path, graphs, new_state=None) -> None:
        if new_state is None:
            width = path.tokens.shape[1]
            extension = (path.hidden.to(self.state.last_hidden.dtype), path.tokens, path.num_new)
            new_state, _ = graphs.call(("extend", width), self._extend_fn, [*state_rows, *extension], rows.shape[0])
        for f, value in zip(EAGLE_FIELDS[1:], new_state):
            getattr(self.state, f)[rows] = value[: rows.shape[0]]

    def finish(self) -> None:
        if self.state is not None:
            self.cache.free(self.state.block_table)
            self.state = None

    def load_published(self, holder) -> None:
        self.module.maybe_update(holder)

    # -- graphs -------------------------------------------------------------------------------------
    def graph_specs(self, strategies, widths):
        # The multi-step tree draft and the KV extension are dozens of small kernels each: eager, they cost more
        # than the verify forward. One graph per strategy (draft) and per tree width (extend: the accepted path is
        # at most T pairs), padded like the verify graphs.
        specs = [(self._draft_key(s), self._draft_fn(s), self._pad_rows) for s in strategies
                 if self._draft_key(s) is not None]
        specs += [(("extend", w), self._extend_fn, lambda p, w=w: self._pad_rows(p, width=w)) for w in widths]
        return specs

    def graph_names(self, strategy, path_width=None):
        draft_key = self._draft_key(strategy)
        return ([] if draft_key is None else [draft_key]), [("extend", path_width or self.tree_width(strategy))]

    def fused_functions(self, strategy):
        draft = self._draft_fn(strategy) if self.tree_width(strategy) > 1 else None
        return draft, self._extend_accepted

    def pad_state_rows(self, batch_size: int):
        return self._pad_rows(batch_size)

    def _draft_key(self, strategy):
        return None if self.tree_width(strategy) == 1 else ("draft", strategy.num_steps, strategy.topk, strategy.num_verify)

    def _draft_fn(self, strategy):
        def draft(block_table, context_lens, last_hidden, root_tokens):
            tree = self.module.draft(EagleState(block_table, context_lens, last_hidden, root_tokens), self.cache,
                                     strategy.num_steps, strategy.topk, strategy.num_verify).tree
            return tree.draft_tokens, tree.parents.to(torch.int32), tree.num_nodes.to(torch.int32)

        return draft

    def _start_fn(self, block_table, prompts, prompt_lens, first_tokens, prefill_hidden):
        """``(context_lens, last_hidden, root_tokens)`` of a new state after the prompts' pairs. No check (no host
        sync, so these launches overlap the target's prefill): ``prompt_lens <= L`` and each row of ``block_table``
        holds ``slots_per_request`` slots."""
        B, L = prompts.shape
        dev = prompts.device
        next_tokens = torch.zeros(B, L, dtype=torch.int64, device=dev)
        next_tokens[:, :-1] = prompts[:, 1:]
        next_tokens.scatter_(1, (prompt_lens.to(torch.int64) - 1).unsqueeze(1), first_tokens.unsqueeze(1))
        state = EagleState(block_table, torch.zeros(B, dtype=torch.int32, device=dev),
                           torch.zeros(B, self.module.config.hidden_size, dtype=self.dtype, device=dev),
                           torch.zeros(B, dtype=torch.int64, device=dev))
        # Causal attention over the prompts' pairs only (the state is new); the fused extension would compile a
        # kernel variant for each new padded prompt length, mid-rollout.
        self.module.prefill(state, self.cache, prefill_hidden.to(self.dtype), next_tokens,
                            prompt_lens.to(torch.int32), validate=False)
        return state.context_lens, state.last_hidden, state.root_tokens

    def _start_padding(self, p: int, length: int):
        """``p`` padding prompts of one token each, their pair written into the sink block 0."""
        dev = self.device
        blocks = self.module.blocks_per_request(self.slots_per_request, self.cache.block_size)
        return [torch.zeros(p, blocks, dtype=torch.int32, device=dev),
                torch.zeros(p, length, dtype=torch.int64, device=dev), torch.ones(p, dtype=torch.int64, device=dev),
                torch.zeros(p, dtype=torch.int64, device=dev),
                torch.zeros(p, length, self.module.config.hidden_size, dtype=self.dtype, device=dev)]

    def _extend_fn(self, block_table, context_lens, last_hidden, root_tokens, features, next_tokens, num_new):
        state = EagleState(block_table, context_lens, last_hidden, root_tokens)
        # No check (no host sync): every row holds slots_per_request slots, more than a request ever commits.
        self.module.extend(state, self.cache, features, next_tokens, num_new, validate=False)
        return state.context_lens, state.last_hidden, state.root_tokens

    def _extend_accepted(self, state_rows, emitted, num_accepted, path_hidden):
        """The fused step's commit: extend the drafter with the accepted path (the cast is inside the graph)."""
        return list(self._extend_fn(*state_rows, path_hidden.to(state_rows[2].dtype), emitted.clamp(min=0),
                                    (num_accepted + 1).to(torch.int32)))

    def _pad_rows(self, p: int, width: Optional[int] = None):
        """``p`` padding rows of drafter state (the drafter graphs' example inputs), plus extend's inputs when
        ``width``."""
        dev, dtype = self.device, self.dtype
        hidden_size = self.module.config.hidden_size
        blocks = self.module.blocks_per_request(self.slots_per_request, self.cache.block_size)
        rows = [torch.zeros(p, blocks, dtype=torch.int32, device=dev), torch.zeros(p, dtype=torch.int32, device=dev),
                torch.zeros(p, hidden_size, dtype=dtype, device=dev), torch.zeros(p, dtype=torch.int64, device=dev)]
        if width is not None:
            rows += [torch.zeros(p, width, hidden_size, dtype=dtype, device=dev),
                     torch.zeros(p, width, dtype=torch.int64, device=dev), torch.zeros(p, dtype=torch.int32, device=dev)]
        return rows
