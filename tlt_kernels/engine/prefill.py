"""The rollout's prefill as CUDA graphs, one per prompt-length bucket (``SpeculativeEngine(prefill_lengths=)``).

An eager prefill is host-bound on a small model: hundreds of launches over the layers for a few milliseconds of GPU
work (docs/MODELS.md, "A fixed cost per rollout"). A batch of fresh prompts whose longest fits a bucket is padded
to the bucket's length (pad tokens: id 0; the outputs of valid positions do not change, see
:meth:`~tlt_kernels.models.LlamaForCausalLM.prefill_fresh`) and replays that bucket's graph at the smallest captured
batch size that holds it; the rows past the batch are padding requests that write the engine's sink request. Any
other batch (a longer prompt, a batch size without a graph, graphs not captured) runs the eager prefill. A drafter
that captures its start (``prefill_graph_specs``, such as the EAGLE drafter's) has its graphs at the same buckets and
batch sizes.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..drafter.base import prefill_graph_specs


def check_prefill_max_tokens(max_tokens: int) -> int:
    """``prefill_max_tokens`` as a positive int (ValueError naming the argument)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"prefill_max_tokens must be a positive int, got {max_tokens!r}")
    return max_tokens


def check_prefill_lengths(lengths: Sequence[int], max_seq_len: int) -> Tuple[int, ...]:
    """``prefill_lengths`` as sorted distinct ints in ``[1, max_seq_len]`` (ValueError naming the argument)."""
    values = tuple(lengths)
    if any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= max_seq_len for v in values):
        raise ValueError(f"prefill_lengths must be ints in [1, max_seq_len={max_seq_len}], got {list(values)}")
    return tuple(sorted(set(values)))


class PrefillGraphs:
    """Graph ``("prefill", L)`` per bucket ``L`` of ``lengths``: ``(tokens int64 [b, L], lengths int32 [b],
    block_table int32 [b, W]) -> (logits [b, V], hidden [b, L, H])`` of ``target.prefill_fresh`` into ``cache``."""

    def __init__(self, target, cache, sink_table: torch.Tensor, graphs, lengths: Sequence[int],
                 max_tokens: int = 32768):
        self.target, self.cache, self.sink_table, self.graphs = target, cache, sink_table, graphs
        self.lengths, self.max_tokens = tuple(lengths), max_tokens

    def register(self, batch_sizes: Sequence[int], drafter=None) -> None:
        """Add every bucket's graph to the pool at those of ``batch_sizes`` whose ``batch x bucket`` is at most
        ``max_tokens`` (a graph's activations and static hidden states grow with it; larger batches run eagerly),
        and at the same sizes ``drafter``'s start graphs for the bucket (``prefill_graph_specs``, optional)."""
        for length in self.lengths:
            sizes = [b for b in batch_sizes if b * length <= self.max_tokens]
            if sizes:
                self.graphs.pool.add(("prefill", length), self._prefill, sizes,
                                     lambda b, length=length: self._padding_inputs(b, length))
                for name, fn, example_inputs in prefill_graph_specs(drafter, [length]):
                    self.graphs.pool.add(name, fn, sizes, example_inputs)

    def _prefill(self, tokens, lengths, block_table):
        return self.target.prefill_fresh(tokens, lengths, self.cache, block_table)

    def _padding_inputs(self, batch_size: int, length: int):
        """Padding requests: one token each, written into the sink request's first slot."""
        device = self.sink_table.device
        return (torch.zeros(batch_size, length, dtype=torch.int64, device=device),
                torch.ones(batch_size, dtype=torch.int32, device=device),
                self.sink_table.expand(batch_size, -1).contiguous())

    def bucket(self, length: int) -> Optional[int]:
        """The shortest bucket that holds a prompt of ``length`` tokens (None: longer than every bucket)."""
        return next((b for b in self.lengths if b >= length), None)

    def replayed_bucket(self, batch_size: int, length: int) -> Optional[int]:
        """The bucket whose captured graph holds ``batch_size`` prompts of up to ``length`` tokens (None: the eager
        prefill runs)."""
        bucket = self.bucket(length)
        if bucket is None or self.graphs.padded_size(("prefill", bucket), batch_size) is None:
            return None
        return bucket

    def run(self, tokens: torch.Tensor, lengths: torch.Tensor,
            block_table: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(logits [B, V], hidden [B, L, H])`` of fresh prompts ``tokens [B, L]`` from a replayed graph, or None
        when no captured graph holds the batch (the caller runs the eager prefill). The outputs are views of the
        graph's static buffers: read them before the next prefill."""
        batch_size, length = tokens.shape
        bucket = self.replayed_bucket(batch_size, length)
        if bucket is None:
            return None
        padded = F.pad(tokens, (0, bucket - length)) if bucket > length else tokens
        logits, hidden = self.graphs.replay(("prefill", bucket), [padded, lengths.to(torch.int32), block_table],
                                            batch_size)
        return logits, hidden[:, :length].contiguous()  # the eager prefill's layout: consumers may view it
