"""Counting Triton JIT compiles during a timed region: a compile costs a rollout hundreds of milliseconds, so a row
says how many happened while it was timed (0 is what an engine that was warmed up should show).

Triton calls ``triton.knobs.runtime.jit_post_compile_hook`` after each compile (a kernel variant not yet in this
process's cache, from source or from the on-disk cache); under ``TRITON_INTERPRET=1`` nothing compiles, so the count is
0 on the CPU.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Tuple


class CompileCounter:
    """``with CompileCounter() as jit: ...`` then ``jit.count`` (compiles inside the block), ``jit.kernels``
    (a Counter of kernel names) and ``jit.variants`` (each compile's kernel name and scalar constexpr values: which
    specialization was new, the clue to what a warm-up missed). Chains to a hook that was already installed, and
    restores it on exit."""

    def __init__(self):
        self.kernels: Counter = Counter()
        self.variants: List[Tuple[str, Dict[str, object]]] = []
        self._previous = None
        self._knobs = None

    @property
    def count(self) -> int:
        return sum(self.kernels.values())

    def describe(self, where: str) -> str:
        """A note for a row: ``"<where>: N Triton compiles: kernel n, ..."``."""
        kernels = ", ".join(f"{name} {n}" for name, n in self.kernels.most_common())
        variants = "; ".join(f"{name}({', '.join(f'{k}={v}' for k, v in constants.items())})"
                             for name, constants in self.variants if constants)
        return f"{where}: {self.count} Triton compiles: {kernels}" + (f" [{variants}]" if variants else "")

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or "?"
        self.kernels[name] += 1
        self.variants.append((name, _scalar_constants(fn, kwargs.get("compile"))))
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


def _scalar_constants(fn, compile_info) -> Dict[str, object]:
    """The compile's constexpr values that are numbers or bools, by parameter name where the kernel's argument
    names are known (Triton keys constants by argument index tuples), else by the key's text."""
    constants = (compile_info or {}).get("constants") or {}
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
    out: Dict[str, object] = {}
    for key, value in constants.items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else key
        name = names[index] if isinstance(index, int) and 0 <= index < len(names) else str(key)
        if isinstance(value, (bool, int, float)):
            out[name] = value
    return out
