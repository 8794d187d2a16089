"""Policies behind :class:`~tlt_kernels.runtime.selector.StrategySelector`, by name.

* ``"beg"``, ``"ucb"``, ``"thompson"``: model-free bandits (:mod:`.bandit`).
* ``"cost"`` (the default): :class:`CostModelPolicy` (:mod:`.cost_model`), composed of a shared acceptance model
  (:mod:`.acceptance_model`), a step-time model over the start-up :class:`CostTable` (:mod:`.step_time_model`,
  :mod:`.cost_table`) and a change detector (:mod:`.change_detector`).
* ``"counterfactual"``: :class:`CounterfactualPolicy` (:mod:`.counterfactual`), follow the leader over every arm's
  acceptance, for a drafter that scores every arm's drafts at every step (the n-gram one).
"""
from __future__ import annotations

from typing import Dict, Type

from .acceptance_model import SharedAcceptanceModel
from .bandit import BucketedEpsilonGreedy, DiscountedThompson, SlidingWindowUCB
from .base import MAX_REWARD, Policy
from .change_detector import ChangeDetector, CusumChangeDetector, NoChangeDetector
from .cost_model import CostModelPolicy
from .cost_table import CostTable
from .counterfactual import CounterfactualPolicy
from .step_time_model import StepTimeModel

POLICIES: Dict[str, Type[Policy]] = {
    "beg": BucketedEpsilonGreedy,
    "ucb": SlidingWindowUCB,
    "thompson": DiscountedThompson,
    "cost": CostModelPolicy,
    "counterfactual": CounterfactualPolicy,
}


def make_policy(policy, **kwargs) -> Policy:
    """A :class:`Policy` instance from a name of :data:`POLICIES` and its options, or ``policy`` itself."""
    if isinstance(policy, Policy):
        if kwargs:
            raise ValueError(f"policy options {sorted(kwargs)} given with a Policy instance; set them on the instance")
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {sorted(POLICIES)} or a Policy instance")
    return POLICIES[policy](**kwargs)


__all__ = [
    "MAX_REWARD",
    "POLICIES",
    "BucketedEpsilonGreedy",
    "ChangeDetector",
    "CostModelPolicy",
    "CostTable",
    "CounterfactualPolicy",
    "CusumChangeDetector",
    "DiscountedThompson",
    "NoChangeDetector",
    "Policy",
    "SharedAcceptanceModel",
    "SlidingWindowUCB",
    "StepTimeModel",
    "make_policy",
]
