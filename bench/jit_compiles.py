"""Counting Triton JIT compiles during a timed region: a compile costs a rollout hundreds of milliseconds, so a row
says how many happened while it was timed (0 is what an engine that was warmed up should show).

Triton calls ``triton.knobs.runtime.jit_post_compile_hook`` after each compile (a kernel variant not yet in this
process's cache, from source or from the on-disk cache); under ``TRITON_INTERPRET=1`` nothing compiles, so the count is
0 on the CPU.
"""
from __future__ import annotations

from collections import Counter


class CompileCounter:
    """``with CompileCounter() as jit: ...`` then ``jit.count`` (compiles inside the block) and ``jit.kernels``
    (a Counter of kernel names). Chains to a hook that was already installed, and restores it on exit."""

    def __init__(self):
        self.kernels: Counter = Counter()
        self._previous = None
        self._knobs = None

    @property
    def count(self) -> int:
        return sum(self.kernels.values())

    def describe(self, where: str) -> str:
        """A note for a row: ``"<where>: N Triton compiles: kernel n, ..."``."""
        kernels = ", ".join(f"{name} {n}" for name, n in self.kernels.most_common())
        return f"{where}: {self.count} Triton compiles: {kernels}"

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.kernels[getattr(fn, "name", None) or "?"] += 1
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def __enter__(self) -> "CompileCounter":
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles
            return self
        self._knobs = knobs.runtime
        self._previous = self._knobs.jit_post_compile_hook
        self._knobs.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None
