"""The draft vocabulary of an EAGLE drafter (:meth:`~tlt_kernels.drafter.EagleDrafter.set_draft_vocab`): the tokens
a model's own text uses most, ranked by count.

A drafter's head scores every token of the vocabulary at every draft depth, yet the tokens it drafts that the target
then accepts come from a small set: the model's frequent ones (FR-Spec, Zhao et al. 2025, "Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"). Drafting from the ``N`` most frequent
makes each depth's head GEMM and top-k ``V / N`` times smaller; verification is unchanged, so the output is too.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .._validation import check_int


def frequent_tokens(sequences: Iterable[Sequence[int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences``, ascending by id (the whole vocabulary's tie order).

    Ranking: by count, most first; equal counts (unseen tokens included) by id, the lower first (in byte-pair
    vocabularies a lower id is an earlier merge, a more frequent piece).

    Args:
        sequences: token id lists (a model's generations: its answers, not its prompts, are what a drafter drafts).
        size: ``1 <= size <= vocab_size`` tokens to keep.
        vocab_size: the model's vocabulary; every id must lie in ``[0, vocab_size)``.

    Returns:
        int64 ``[size]`` on the CPU, sorted ascending.
    """
    check_int("vocab_size", vocab_size, 1)
    check_int("size", size, 1)
    if size > vocab_size:
        raise ValueError(f"size must be <= vocab_size={vocab_size}, got {size}")
    ids = [torch.as_tensor(list(s), dtype=torch.int64) for s in sequences]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        raise ValueError(f"sequences hold token ids outside [0, vocab_size={vocab_size}): "
                         f"{int(flat.min())} to {int(flat.max())}")
    counts = torch.bincount(flat, minlength=vocab_size)
    ranked = torch.argsort(-counts, stable=True)  # a stable sort keeps equal counts in id order
    return ranked[:size].sort().values
