"""Speculative strategies and lazily-resolved observations.

A :class:`Strategy` is one arm of the selector: ``num_steps`` drafter steps (the tree depth),
``topk`` children kept per expanded node, and ``num_verify`` tokens verified per request in the
target's forward pass (the root, i.e. the last accepted token, included; SGLang's
``speculative_num_draft_tokens``). Plain decoding is ``Strategy.off() == Strategy(0, 0, 1)``.

Observations may arrive before the GPU has produced them: ``elapsed_s`` can be a pair of CUDA events
and the token counts a CUDA tensor. :func:`as_pending` wraps them so the selector polls ``ready()``
(``cudaEventQuery``, never a wait) and folds them in on a later call -- no added host sync.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True, order=True)
class Strategy:
    """One speculative-decoding configuration.

    Args:
        num_steps: drafter steps per verify (tree depth); 0 means plain decoding.
        topk: children kept per expanded node (1 = a chain); 0 for plain decoding.
        num_verify: tokens verified per request per step, root included; 1 for plain decoding.
    """

    num_steps: int
    topk: int
    num_verify: int

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_verify"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"Strategy.{name} must be a non-negative int, got {v!r}")
        if self.num_steps == 0:
            if (self.topk, self.num_verify) != (0, 1):
                raise ValueError(
                    f"plain decoding is Strategy(0, 0, 1); got num_steps=0 with topk={self.topk}, "
                    f"num_verify={self.num_verify}"
                )
            return
        if self.topk < 1:
            raise ValueError(f"Strategy.topk must be >= 1 when num_steps={self.num_steps} > 0, got {self.topk}")
        # EAGLE-2 style: num_verify - 1 draft nodes picked from topk + (num_steps-1)*topk^2 candidates.
        max_nodes = self.topk + (self.num_steps - 1) * self.topk * self.topk
        if not 2 <= self.num_verify <= 1 + max_nodes:
            raise ValueError(
                f"Strategy.num_verify must be in [2, 1 + topk + (num_steps-1)*topk^2] = [2, {1 + max_nodes}] for "
                f"num_steps={self.num_steps}, topk={self.topk}; got {self.num_verify}"
            )

    @classmethod
    def off(cls) -> "Strategy":
        """Plain decoding (no drafter): always an arm of the selector."""
        return cls(0, 0, 1)

    @property
    def is_off(self) -> bool:
        return self.num_steps == 0

    @property
    def max_tokens_per_step(self) -> int:
        """Tokens one request can emit per step: the accepted draft path plus the bonus token."""
        return self.num_steps + 1

    def __str__(self) -> str:
        return "off" if self.is_off else f"s{self.num_steps}k{self.topk}v{self.num_verify}"

    @classmethod
    def parse(cls, text: str) -> "Strategy":
        """Inverse of ``str()``: ``"off"`` or ``"s3k1v4"``."""
        if text == "off":
            return cls.off()
        try:
            s, rest = text[1:].split("k")
            k, v = rest.split("v")
            return cls(int(s), int(k), int(v))
        except Exception:
            raise ValueError(f"cannot parse strategy {text!r}; expected 'off' or like 's3k1v4'") from None


class Pending:
    """A value the GPU has not produced yet. ``ready()`` must not block; ``get()`` is called once ready."""

    def ready(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def get(self) -> Any:  # pragma: no cover - interface
        raise NotImplementedError


class EventTimer(Pending):
    """Seconds between two recorded CUDA events (``torch.cuda.Event(enable_timing=True)``)."""

    __slots__ = ("start", "end")

    def __init__(self, start, end):
        self.start, self.end = start, end

    def ready(self) -> bool:
        return self.end.query()

    def get(self) -> float:
        return self.start.elapsed_time(self.end) * 1e-3


class DeferredTensor(Pending):
    """A (CUDA) tensor copied to pinned host memory without waiting; ready once the copy event fires.

    Use for ``emitted_tokens`` (a 0-d / 1-element tensor) and ``accepted_per_position`` (``[num_steps]``).
    """

    __slots__ = ("host", "event")

    def __init__(self, t):
        import torch

        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = t, None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self):
        return self.host.item() if self.host.dim() == 0 else self.host.tolist()


class CallbackValue(Pending):
    """A user callback returning the value, or ``None`` while it is not available yet."""

    __slots__ = ("fn", "_value")

    def __init__(self, fn: Callable[[], Optional[Any]]):
        self.fn, self._value = fn, None

    def ready(self) -> bool:
        if self._value is None:
            self._value = self.fn()
        return self._value is not None

    def get(self):
        return self._value


def as_pending(value):
    """Normalize an observation field: plain numbers/lists pass through, GPU handles become :class:`Pending`."""
    if value is None or isinstance(value, (int, float, list, Pending)):
        return value
    if isinstance(value, tuple):
        if len(value) == 2 and hasattr(value[1], "query") and hasattr(value[0], "elapsed_time"):
            return EventTimer(*value)
        return list(value)
    if callable(value):
        return CallbackValue(value)
    try:
        import torch
    except ImportError:  # pragma: no cover
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            return DeferredTensor(value)
        return value.item() if value.dim() == 0 else value.tolist()
    if hasattr(value, "tolist"):  # numpy scalars / arrays
        return value.tolist()
    raise TypeError(
        f"observation of type {type(value).__name__} is not supported; pass a number, a list, a tensor, "
        "a (start, end) CUDA event pair, a Pending, or a callback returning None until ready"
    )
