"""Versioned drafter weights, published by the trainer and swapped in by the runtime.

The trainer calls :meth:`WeightsHolder.publish` after some steps; it snapshots (clones) the
drafter's ``state_dict`` into an immutable :class:`DrafterWeights` and replaces the holder's
reference under a lock. Readers take the reference once (:meth:`WeightsHolder.latest`) and load it
between decoding steps (:meth:`EagleDrafter.maybe_update`), so a decoding step never sees a mix
of two versions and the trainer never has to wait for the rollout.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional

import torch


@dataclass(frozen=True)
class DrafterWeights:
    """One published version: ``version`` (``>= 1``, increasing) and a detached ``state_dict``."""

    version: int
    state_dict: Dict[str, torch.Tensor]


class WeightsHolder:
    """Latest published :class:`DrafterWeights` (thread-safe, atomic swap of one reference)."""

    def __init__(self, device: Optional[torch.device] = None):
        self._lock = threading.Lock()
        self._latest: Optional[DrafterWeights] = None
        self.device = device

    @property
    def version(self) -> int:
        w = self._latest
        return 0 if w is None else w.version

    def latest(self) -> Optional[DrafterWeights]:
        return self._latest

    def publish(self, state_dict: Dict[str, torch.Tensor], version: Optional[int] = None) -> DrafterWeights:
        """Snapshot ``state_dict`` as the next version (or exactly ``version``, e.g. after a resume)."""
        snap = {k: v.detach().to(self.device or v.device, copy=True) for k, v in state_dict.items()}
        with self._lock:
            v = self.version + 1 if version is None else int(version)
            if v <= self.version:
                raise ValueError(f"version must increase: holder is at {self.version}, got {v}")
            w = DrafterWeights(v, snap)
            self._latest = w
        return w

    def put(self, weights: DrafterWeights) -> None:
        """Install weights received from elsewhere (e.g. a broadcast) if newer than the current."""
        with self._lock:
            if weights.version > self.version:
                self._latest = weights
