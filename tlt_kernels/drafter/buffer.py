"""Bounded buffer of rollout sequences (target features + tokens) for the spot trainer.

Each entry is one rollout segment of ``n`` positions: ``features [n, H]`` (the target's last-layer
hidden states, before the final norm) and ``tokens int64 [n]`` (the token at each position), tagged
with the RL step that produced it. Training pairs are ``(features[p], tokens[p+1])`` with targets
``features[p+1]`` (see :mod:`tlt_kernels.drafter.eagle`).

The buffer holds at most ``capacity_tokens`` positions; the oldest RL step is evicted first.
Sampling favours recent steps: an entry of step ``s`` is drawn with weight
``n * recency_decay ** (newest_step - s)``, since the target has drifted away from old data.
"""
from __future__ import annotations

import numbers
from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple

import torch

from .._validation import check_positive_ints


@dataclass
class _Entry:
    features: torch.Tensor  # [n, H]
    tokens: torch.Tensor  # int64 [n]
    step: int
    ready: Optional["torch.cuda.Event"] = None  # pinned copies: done once this event is (None: already done)

    def wait(self) -> None:
        """Block until the entry's asynchronous copy (if any) has landed; only the reader waits."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def landed(self) -> bool:
        """Whether the entry's copy has landed (never waits)."""
        if self.ready is not None and self.ready.query():
            self.ready = None
        return self.ready is None


@dataclass
class TrainBatch:
    """A padded training batch of ``B`` windows of ``S + 1`` positions.

    ``features [B, S+1, H]`` (float32), ``tokens int64 [B, S+1]``, ``positions int64 [B, S+1]``
    (absolute positions, for RoPE), ``valid bool [B, S]``: pair ``p`` has a target
    (``features[:, p+1]`` exists), ``steps int64 [B]``: RL step of each window.
    """

    features: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    steps: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return int(self.valid.sum())


def _lengths(lengths, B: int, n: int) -> list:
    """``lengths`` (tensor or sequence) as ``B`` ints in ``[0, n]``, or a ValueError naming the first bad row."""
    vals = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    if isinstance(lengths, torch.Tensor) and lengths.dim() != 1:
        raise ValueError(f"lengths must be an int [B={B}] tensor, got shape {tuple(lengths.shape)}")
    if len(vals) != B:
        raise ValueError(f"lengths has {len(vals)} entries, expected one per row (B={B})")
    for b, v in enumerate(vals):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v <= n:
            raise ValueError(f"lengths[{b}] = {v!r} is outside [0, n={n}] (the positions stored for the row)")
    return vals


class RolloutBuffer:
    """Bounded, step-tagged store of ``(features, tokens)`` rollout segments.

    Args:
        capacity_tokens: maximum positions kept (oldest step evicted first).
        recency_decay: sampling weight factor per step of age, in ``(0, 1]`` (1 = uniform).
        device: where entries are stored (``"cpu"`` frees GPU memory for the rollout). From a CUDA
            rollout into the CPU, ``pin_memory=True`` makes the copy asynchronous: :meth:`add` then never
            waits for the GPU (without it, every add drains the GPU's queue), and :meth:`sample` waits for the
            copies it reads. A CUDA ``device`` keeps entries on the GPU (asynchronous as well).
        storage_dtype: dtype of the stored features (bf16 halves memory; training upcasts).
    """

    def __init__(self, capacity_tokens: int, recency_decay: float = 0.7, device="cpu", storage_dtype=torch.bfloat16, pin_memory: bool = False):
        if capacity_tokens < 2:
            raise ValueError(f"capacity_tokens must be >= 2, got {capacity_tokens}")
        if not 0.0 < recency_decay <= 1.0:
            raise ValueError(f"recency_decay must be in (0, 1], got {recency_decay}")
        self.capacity_tokens = capacity_tokens
        self.recency_decay = recency_decay
        self.device = torch.device(device)
        self.storage_dtype = storage_dtype
        self.pin_memory = pin_memory and self.device.type == "cpu" and torch.cuda.is_available()
        self._entries: Deque[_Entry] = deque()
        self.num_tokens = 0
        self.newest_step = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _store(self, t: torch.Tensor, dtype) -> torch.Tensor:
        if self.pin_memory:
            out = torch.empty(t.shape, dtype=dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return t.detach().to(device=self.device, dtype=dtype, copy=True)

    def add(self, features: torch.Tensor, tokens: torch.Tensor, step: int, lengths: Optional[torch.Tensor] = None) -> None:
        """Add rollout segments.

        Args:
            features: ``[n, H]`` or ``[B, n, H]`` target features.
            tokens: ``int64 [n]`` or ``[B, n]`` token at each position.
            step: RL step that produced them.
            lengths: ``int [B]`` valid positions per row, each in ``[0, n]`` (batched form only; default all
                ``n``). A length past ``n`` raises ValueError: the entry would count positions it does not hold.
        """
        if features.dim() == 2:
            features, tokens = features.unsqueeze(0), tokens.unsqueeze(0)
        if features.dim() != 3 or tokens.shape != features.shape[:2]:
            raise ValueError(
                f"features must be [n, H] or [B, n, H] and tokens [n] or [B, n] to match; got "
                f"features {tuple(features.shape)}, tokens {tuple(tokens.shape)}"
            )
        B, n, _ = features.shape
        lens = [n] * B if lengths is None else _lengths(lengths, B, n)
        added = []
        for b in range(B):
            m = lens[b]
            if m < 2:
                continue  # no (pair, target) in a segment shorter than 2
            added.append(_Entry(self._store(features[b, :m], self.storage_dtype), self._store(tokens[b, :m], torch.int64), int(step)))
            self.num_tokens += m
        if added and self.pin_memory and features.is_cuda:  # the copies were queued on the current stream
            ready = torch.cuda.Event()
            ready.record()
            for entry in added:
                entry.ready = ready
        self._entries.extend(added)
        self.newest_step = max(self.newest_step, int(step))
        self._evict()

    def _evict(self) -> None:
        while self.num_tokens > self.capacity_tokens and len(self._entries) > 1:
            # Entries arrive in step order in practice; pick the oldest step to be safe.
            oldest = min(range(len(self._entries)), key=lambda i: self._entries[i].step)
            e = self._entries[oldest]
            del self._entries[oldest]
            self.num_tokens -= e.features.shape[0]

    def take(self, landed_only: bool = False) -> List[Tuple[torch.Tensor, torch.Tensor, int]]:
        """Remove every entry and return them oldest first as ``(features [n, H], tokens int64 [n], step)``, each
        after its copy landed: how a trainer in another process receives them (:class:`SpotTrainerProcess`).
        ``landed_only``: never wait; take the entries whose copies have landed, keep the others."""
        taken, kept = [], deque()
        while self._entries:
            entry = self._entries.popleft()
            if landed_only and not entry.landed():
                kept.append(entry)
                continue
            entry.wait()
            taken.append((entry.features, entry.tokens, entry.step))
            self.num_tokens -= entry.tokens.shape[0]
        self._entries = kept
        return taken

    def steps(self) -> torch.Tensor:
        return torch.tensor([e.step for e in self._entries], dtype=torch.int64)

    def sample(self, batch_size: int, seq_len: int, generator: Optional[torch.Generator] = None, device=None) -> TrainBatch:
        """Draw ``batch_size`` windows of ``seq_len`` pairs (``seq_len + 1`` positions).

        Windows start uniformly inside their entry; shorter entries are zero-padded and masked.
        """
        check_positive_ints("RolloutBuffer.sample", batch_size=batch_size, seq_len=seq_len)
        if not self._entries:
            raise RuntimeError("RolloutBuffer.sample: the buffer is empty; add rollouts first")
        entries = list(self._entries)
        lens = torch.tensor([e.features.shape[0] for e in entries], dtype=torch.float64)
        age = torch.tensor([self.newest_step - e.step for e in entries], dtype=torch.float64)
        w = lens * self.recency_decay ** age
        pick = torch.multinomial(w, batch_size, replacement=True, generator=generator).tolist()
        S1 = seq_len + 1
        H = entries[0].features.shape[1]
        device = torch.device(device) if device is not None else self.device
        feats = torch.zeros(batch_size, S1, H, dtype=torch.float32, device=self.device)
        toks = torch.zeros(batch_size, S1, dtype=torch.int64, device=self.device)
        pos = torch.zeros(batch_size, S1, dtype=torch.int64)
        valid = torch.zeros(batch_size, seq_len, dtype=torch.bool)
        steps = torch.zeros(batch_size, dtype=torch.int64)
        for r, i in enumerate(pick):
            e = entries[i]
            e.wait()
            n = e.features.shape[0]
            hi = max(0, n - S1)
            start = int(torch.randint(hi + 1, (1,), generator=generator)) if hi else 0
            m = min(S1, n - start)
            feats[r, :m] = e.features[start : start + m]
            toks[r, :m] = e.tokens[start : start + m]
            pos[r] = torch.arange(start, start + S1)
            valid[r, : m - 1] = True
            steps[r] = e.step
        nb = device.type == "cuda"
        return TrainBatch(*(t.to(device, non_blocking=nb) for t in (feats, toks, pos, valid, steps)))
