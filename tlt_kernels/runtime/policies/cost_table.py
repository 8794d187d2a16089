"""The start-up table of step times per (strategy, batch size) that the cost model's step-time prediction starts from."""
from __future__ import annotations

import bisect
import math
import numbers
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

from ..strategy import Strategy


def _cost_point(s: Strategy, point) -> Tuple[int, float]:
    """One ``(batch_size, seconds)`` entry of a cost table, validated: a NaN, infinite, zero or negative time or a
    batch size that is not an int >= 1 would poison every prediction made from it."""
    try:
        b, t = point
    except (TypeError, ValueError):
        raise ValueError(f"cost table entry {point!r} for {s} must be a (batch_size, seconds) pair") from None
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
        raise ValueError(f"cost table entry ({b!r}, {t!r}) for {s}: batch_size must be an int >= 1, got {b!r}")
    try:
        secs = float(t)
    except (TypeError, ValueError):
        secs = math.nan
    if not (math.isfinite(secs) and secs > 0):
        raise ValueError(f"cost table entry ({b!r}, {t!r}) for {s}: the step time must be a finite number of seconds "
                         f"> 0, got {t!r}")
    return int(b), secs


class CostTable:
    """Step time per (strategy, batch size), measured at start-up; linear interpolation in batch size.

    ``table[strategy] = [(batch_size, seconds), ...]``. Outside the measured range the nearest
    measured point is scaled linearly in batch size beyond the largest, held below the smallest.
    """

    def __init__(self, table: Dict[Strategy, Sequence[Tuple[int, float]]]):
        if not isinstance(table, Mapping):
            raise TypeError(f"cost table must be a {{Strategy: [(batch_size, seconds), ...]}} dict, got {type(table).__name__}")
        self.table = {}
        for s, pts in table.items():
            if not isinstance(s, Strategy):
                raise TypeError(f"cost table keys must be Strategy objects, got {type(s).__name__}: {s!r}")
            pts = sorted(_cost_point(s, p) for p in pts)
            if not pts:
                raise ValueError(f"cost table for {s} has no points")
            for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
                if b0 == b1:
                    raise ValueError(f"cost table for {s} has two times for batch_size={b0} ({t0} and {t1} s); keep one")
            self.table[s] = ([b for b, _ in pts], [t for _, t in pts])

    @classmethod
    def measure(cls, step_fn: Callable[[Strategy, int], float], strategies: Sequence[Strategy],
                batch_sizes: Sequence[int], repeats: int = 5) -> "CostTable":
        """Build the table from ``step_fn(strategy, batch_size) -> seconds`` (median of ``repeats``).

        On the GPU ``step_fn`` would replay the captured graph between two CUDA events; in the simulator
        it returns a noisy draw of the workload's step cost.
        """
        tab = {}
        for s in strategies:
            pts = []
            for b in batch_sizes:
                ts = sorted(step_fn(s, b) for _ in range(repeats))
                pts.append((b, ts[len(ts) // 2]))
            tab[s] = pts
        return cls(tab)

    def __contains__(self, s: Strategy) -> bool:
        return s in self.table

    def predict(self, strategy: Strategy, batch_size: int) -> Optional[float]:
        """Predicted step time in seconds of ``strategy`` at ``batch_size`` (int >= 1), or None without an entry."""
        entry = self.table.get(strategy)
        if entry is None:
            return None
        bs, ts = entry
        i = bisect.bisect_left(bs, batch_size)
        if i < len(bs) and bs[i] == batch_size:
            return ts[i]
        if i == 0:
            return ts[0]
        if i == len(bs):
            return ts[-1] * batch_size / bs[-1]
        b0, b1, t0, t1 = bs[i - 1], bs[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
