"""Drafters for adaptive speculative decoding and the spot trainer that keeps them current.

* :class:`NGramDrafter` -- model-free prompt-lookup drafts from device-resident histories;
* :class:`EagleDrafter` -- one-layer EAGLE drafter sharing the target's embedding, final norm and
  LM head, with its own paged KV cache and EAGLE-2 tree drafting;
* :class:`SpotTrainer` -- preemptible training in idle windows from a :class:`RolloutBuffer`,
  publishing :class:`DrafterWeights` versions through a :class:`WeightsHolder`; :class:`SpotTrainerProcess` runs
  one in a worker process of its own (no interpreter shared with the rollout);
* :class:`DrafterQuality` / :func:`evaluate_acceptance` -- accepted-length tracking;
* :func:`frequent_tokens` -- a draft vocabulary (:meth:`EagleDrafter.set_draft_vocab`) from a model's own text;
* :mod:`tlt_kernels.drafter.distributed` -- data-parallel training and weight broadcast;
* :class:`Drafter` -- the interface :class:`~tlt_kernels.engine.SpeculativeEngine` drives
  (:class:`NoDrafter`, :class:`NGramRolloutDrafter`, :class:`EagleRolloutDrafter`, or a user's
  :class:`DrafterBase` subclass; docs/DRAFTERS.md, "Writing your own drafter").
"""
from .base import AcceptedPath, Drafter, DrafterBase, NoDrafter, ProposedTree
from .buffer import RolloutBuffer, TrainBatch
from .draft_vocab import frequent_tokens
from .eagle_rollout import EagleRolloutDrafter
from .eagle import DrafterKVCache, EagleConfig, EagleDraft, EagleDrafter, EagleState, accepted_length_greedy, num_candidates
from .ngram_drafter import ChainTree, NGramDrafter, drafts_to_tree
from .ngram_rollout import NGramRolloutDrafter
from .spot_process import SpotTrainerProcess
from .spot_trainer import DrafterQuality, RunStats, SpotTrainer, eagle_loss, evaluate_acceptance
from .weights import DrafterWeights, WeightsHolder

__all__ = [
    "AcceptedPath",
    "ChainTree",
    "Drafter",
    "DrafterBase",
    "DrafterKVCache",
    "DrafterQuality",
    "DrafterWeights",
    "EagleConfig",
    "EagleDraft",
    "EagleDrafter",
    "EagleRolloutDrafter",
    "EagleState",
    "NGramDrafter",
    "NGramRolloutDrafter",
    "NoDrafter",
    "ProposedTree",
    "RolloutBuffer",
    "RunStats",
    "SpotTrainer",
    "SpotTrainerProcess",
    "TrainBatch",
    "WeightsHolder",
    "accepted_length_greedy",
    "drafts_to_tree",
    "eagle_loss",
    "evaluate_acceptance",
    "frequent_tokens",
    "num_candidates",
]
