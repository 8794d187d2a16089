"""Adaptive runtime: strategy selection, workload simulation, and a shared CUDA graph pool.

Importing this package never imports Triton or the CUDA extension and never queries a GPU.
"""
from .forecast import AcceptanceForecast
from .graph_pool import GraphPool
from .policies import (
    POLICIES,
    BucketedEpsilonGreedy,
    CostModelPolicy,
    CostTable,
    CounterfactualPolicy,
    DiscountedThompson,
    Policy,
    SlidingWindowUCB,
)
from .selector import DEFAULT_BUCKETS, DEFAULT_POLICY, StrategySelector
from .strategy import CallbackValue, DeferredTensor, EventTimer, Pending, Strategy

__all__ = [
    "POLICIES",
    "AcceptanceForecast",
    "BucketedEpsilonGreedy",
    "CallbackValue",
    "CostModelPolicy",
    "CostTable",
    "CounterfactualPolicy",
    "DEFAULT_BUCKETS",
    "DEFAULT_POLICY",
    "DeferredTensor",
    "DiscountedThompson",
    "EventTimer",
    "GraphPool",
    "Pending",
    "Policy",
    "SlidingWindowUCB",
    "Strategy",
    "StrategySelector",
]
