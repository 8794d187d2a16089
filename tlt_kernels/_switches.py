"""The library's environment switches: the one module of :mod:`tlt_kernels` that reads ``os.environ``.

Every ``TLT_*`` switch is read once, when this module is imported (with :mod:`tlt_kernels`), and never queries a
GPU. Each one selects among kernels that compute the same thing, so none changes a result beyond float rounding;
the defaults are the measured fastest (docs/PERFORMANCE.md, docs/TREE_ATTENTION.md, docs/CUDA_NOTES.md). Set them
before ``import tlt_kernels``. The modules that use a switch copy its value into a module attribute (named below),
which is what tests monkeypatch.

A malformed value is kept here as an error and raised by :meth:`Switch.get`, i.e. when the module that uses the
switch is imported (the CUDA glue modules are imported lazily, at a first CUDA launch), so a bad CUDA-only switch
never breaks ``import tlt_kernels`` on a machine that does not launch the CUDA kernels.

Switches:

``TLT_DIRECT_DISPATCH`` (``0`` / ``1``, default ``1``; :data:`tlt_kernels._backend.DIRECT_DISPATCH`)
    ``1``: plain eager calls of ``verify_tree``, ``compact_kv`` and tree attention's ``plan.run`` launch the kernel
    without going through their ``torch.library`` custom op, whose Python dispatch costs more than the kernel at
    small batch; ``torch.compile`` and any tracing still take the op. ``0``: always through the op (to check that
    both paths agree, or to rule the fast path out).
``TLT_VERIFY_CLUSTER`` (``0``, ``1``, ``2``, ``4``, ``8``, ``16``; default ``0``; :data:`tlt_kernels._cuda.verify_tree.CLUSTER_SIZE`)
    CTAs per request of the CUDA ``verify_tree`` kernel; ``0`` lets the launcher choose. Exists for tests and
    tuning, which force every cluster size.
``TLT_VERIFY_TOPP_COMPACT`` (``0`` / ``1``, default ``1``; :data:`tlt_kernels._cuda.verify_tree.TOPP_COMPACT`)
    ``1``: the CUDA ``verify_tree`` finds its top-p threshold among compacted candidates (the full-row radix
    select's threshold, in fewer passes); ``0``: by the full-row radix select. Kept to compare the two.
``TLT_VERIFY_PARALLEL_ROWS`` (``auto`` / ``0`` / ``1``, default ``auto``; :data:`tlt_kernels._cuda.verify_tree.PARALLEL_ROWS`)
    ``1``: the CUDA ``verify_tree`` first computes every draft node's row statistics at once (one cluster per row),
    then walks over them; ``0``: the walk streams only the rows it visits, one after another; ``auto`` (``None``):
    the measured rule (:func:`tlt_kernels._cuda.verify_tree.parallel_rows`). Exists to A/B the two.
``TLT_TREE_ATTENTION_CUDA_CTX`` (``auto`` / ``0`` / ``1``, default ``auto``; :data:`tlt_kernels._cuda.tree_attention.CONTEXT_SM90`)
    The sm_90 wgmma context kernels of the CUDA tree attention: ``auto`` (``None``) the measured rule, ``1`` wherever
    they cover the shape, ``0`` never (the mma.sync kernel). Exists to A/B the two kernel families.
``TLT_TREE_ATTENTION_CUDA_WS`` (``0`` / ``1``, default ``1``; :data:`tlt_kernels._cuda.tree_attention.CONTEXT_WARP_SPECIALIZED`)
    ``1``: the warp-specialized build of the 128-token sm_90 kernel (producer warpgroup, ping-pong consumers);
    ``0``: the lockstep build. Exists to A/B the two builds.
``TLT_TREE_ATTENTION_CUDA_TMA`` (``auto`` / ``0`` / ``1``, default ``auto``; :data:`tlt_kernels._cuda.tree_attention.CONTEXT_TMA`)
    TMA copies of whole context tiles in the warp-specialized build: ``auto`` (``None``) for wide trees and on
    cards with fast memory, ``1`` everywhere it runs, ``0`` never (16-byte ``cp.async``). Exists to A/B the copies.
``TRITON_INTERPRET`` (``0`` / ``1``, default ``0``; :func:`triton_interpret`)
    Triton's own switch (its CPU interpreter, how CI runs the Triton kernels without a GPU). Unlike the others it
    is read at every call, as Triton reads it when a kernel is defined and tests flip it.

Build-time switches (``TLT_CUDA_ARCHS`` and the like) are read by ``setup.py``, not here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["Switch", "DIRECT_DISPATCH", "VERIFY_CLUSTER", "VERIFY_TOPP_COMPACT", "VERIFY_PARALLEL_ROWS", "TREE_ATTENTION_CUDA_CTX",
           "TREE_ATTENTION_CUDA_WS", "TREE_ATTENTION_CUDA_TMA", "triton_interpret"]


@dataclass(frozen=True)
class Switch:
    """One switch as read at import: its variable ``name``, the parsed ``value`` (None where malformed) and, for a
    malformed value, the ``error`` that :meth:`get` raises."""

    name: str
    value: Any
    error: Optional[str] = None

    def get(self) -> Any:
        """The parsed value; a ValueError naming the variable when it was malformed."""
        if self.error is not None:
            raise ValueError(self.error)
        return self.value


def _on_off(name: str, default: str) -> Switch:
    """``0`` / empty -> False, anything else -> True (the historical reading of these flags)."""
    return Switch(name, os.environ.get(name, default) not in ("", "0"))


def _strict_on_off(name: str, default: str) -> Switch:
    """Unset, empty or ``1`` -> True, ``0`` -> False, anything else an error."""
    value = os.environ.get(name, default).strip()
    if value not in ("", "0", "1"):
        return Switch(name, None, f"{name} must be 0 or 1, got {value!r}")
    return Switch(name, value != "0")


def _auto_on_off(name: str) -> Switch:
    """Unset, empty or ``auto`` -> None (the measured rule), ``1`` -> True, ``0`` -> False, anything else an error."""
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("", "auto", "0", "1"):
        return Switch(name, None, f"{name} must be auto, 0 or 1, got {value!r}")
    return Switch(name, None if value in ("", "auto") else value == "1")


def _int(name: str, default: str) -> Switch:
    """An integer; unset or empty -> ``default``; anything else non-integer an error."""
    raw = os.environ.get(name, default) or default
    try:
        return Switch(name, int(raw))
    except ValueError:
        return Switch(name, None, f"invalid literal for int() with base 10: {raw!r} ({name})")


DIRECT_DISPATCH = _on_off("TLT_DIRECT_DISPATCH", "1")
VERIFY_CLUSTER = _int("TLT_VERIFY_CLUSTER", "0")
VERIFY_TOPP_COMPACT = _on_off("TLT_VERIFY_TOPP_COMPACT", "1")
VERIFY_PARALLEL_ROWS = _auto_on_off("TLT_VERIFY_PARALLEL_ROWS")
TREE_ATTENTION_CUDA_CTX = _auto_on_off("TLT_TREE_ATTENTION_CUDA_CTX")
TREE_ATTENTION_CUDA_WS = _strict_on_off("TLT_TREE_ATTENTION_CUDA_WS", "1")
TREE_ATTENTION_CUDA_TMA = _auto_on_off("TLT_TREE_ATTENTION_CUDA_TMA")


def triton_interpret() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (not empty, not ``0``) now: Triton's CPU interpreter is on."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
