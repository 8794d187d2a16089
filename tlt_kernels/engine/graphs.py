"""The engine's CUDA graphs: replay-or-eager calls on a :class:`~tlt_kernels.runtime.GraphPool`, and the capture
of every registered graph with one retry."""
from __future__ import annotations

import gc
import logging
from typing import Callable, Hashable, List, Optional, Sequence

import torch

log = logging.getLogger("tlt_kernels.engine")


class GraphReplay:
    """``pool`` (a GraphPool or None) and whether its graphs are captured. ``error``: why the capture failed (the
    engine then runs eagerly); ``retry_error``: a first capture failure that the retry recovered from."""

    def __init__(self, pool):
        self.pool = pool
        self.captured = False
        self.error: Optional[str] = None
        self.retry_error: Optional[str] = None

    def registered(self, name: Hashable) -> bool:
        return name in getattr(self.pool, "_entries", {})

    def padded_size(self, name: Optional[Hashable], batch_size: int) -> Optional[int]:
        """The captured size a batch of ``batch_size`` replays ``name`` at; None: no graph (run eagerly)."""
        if not self.captured or name is None or not self.pool.covers(name, batch_size):
            return None
        return self.pool.padded_size(name, batch_size)

    def captured_sizes(self, name: Hashable) -> List[int]:
        """The batch sizes with a captured graph of ``name`` (ascending; empty before capture)."""
        return self.pool.captured_sizes(name) if self.captured else []

    def replay(self, name: Hashable, inputs: Sequence[torch.Tensor], batch_size: int):
        """The outputs of graph ``name`` on ``inputs`` (``batch_size`` rows; padding rows fill the rest), cut to
        ``batch_size`` rows; None when no captured graph covers the batch."""
        padded = self.padded_size(name, batch_size)
        if padded is None:
            return None
        outputs = self.pool.run(name, inputs, batch_size=padded, fill_rest=True)
        return [o[:batch_size] for o in outputs]

    def call(self, name: Optional[Hashable], fn: Callable, inputs: Sequence[torch.Tensor], batch_size: int):
        """``(outputs, replayed)``: graph ``name`` replayed when captured for the batch, else ``fn(*inputs)``."""
        outputs = self.replay(name, inputs, batch_size)
        if outputs is not None:
            return outputs, True
        return fn(*inputs), False

    def capture(self, register: Callable[[], None]) -> bool:
        """``register()`` the graphs, then capture them; a failure is logged and recorded in :attr:`error` (the
        engine runs eagerly). Returns whether the graphs are captured."""
        try:
            register()
            self._capture_with_retry()
            self.captured = True
        except Exception as exc:  # pragma: no cover - depends on the device and backends
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, verifying eagerly: %s", self.error)
            self.captured = False
        return self.captured

    def _capture_with_retry(self) -> None:
        """``pool.capture()``, retried once after a failure: a one-off (such as a first module load inside the
        capture) succeeds on the second try (docs/RUNTIME.md, "Graph capture retry"). Keys captured before the
        failure are kept (the pool skips them); the first error stays in :attr:`retry_error`."""
        try:
            self.pool.capture()
        except Exception as exc:
            self.retry_error = f"{type(exc).__name__}: {exc}"
            log.warning("CUDA graph capture failed, retrying once: %s", self.retry_error)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            gc.collect()
            self.pool.backend.renew_pool()
            self.pool.capture()
