"""Hypothesis profiles, strategies and helpers shared by the property suite (``tests/ops/test_properties_*.py``).

Profiles (chosen by the ``TLT_HYPOTHESIS_PROFILE`` environment variable, default ``ci``):

* ``ci``: few examples per property, ``derandomize=True`` (the same examples on every run, so CI is reproducible),
  sized for a 2-core CPU machine where Triton kernels run in the interpreter (~1 min for the whole suite);
* ``long``: 25x the examples, random (not derandomized), for hunting on demand::

      TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_*.py

* ``dev``: ``ci``'s examples with hypothesis' verbose output (each example printed).

A failing property prints hypothesis' shrunk (minimal) example; paste it into the test's ``@example`` to keep it.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Sequence

import pytest
import torch
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st

# Health checks suppressed, and why: ``too_slow`` -- Triton kernels run in the CPU interpreter (tenths of a second
# per call) and the strategies build tensors; ``data_too_large`` / ``large_base_example`` -- a problem draws one
# value per tree node / sampling parameter, which can exceed hypothesis' default budget for the largest sizes.
_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
             HealthCheck.filter_too_much]
# No "explain" phase in CI: it re-runs a failing example many times (slow with interpreted kernels); shrinking stays,
# so a failure still prints a minimal example.
_CI_PHASES = (Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink)
settings.register_profile("ci", max_examples=10, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SUPPRESS, print_blob=True, phases=_CI_PHASES)
settings.register_profile("long", max_examples=250, deadline=None, derandomize=False,
                          suppress_health_check=_SUPPRESS, print_blob=True)
settings.register_profile("dev", parent=settings.get_profile("ci"), verbosity=Verbosity.verbose)
PROFILE = os.environ.get("TLT_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
_SCALE = {"long": 25}.get(PROFILE, 1)


def budget(n: int):
    """``@settings`` with ``n`` examples in the ``ci`` profile (scaled up in ``long``)."""
    return settings(max_examples=max(1, n * _SCALE))


TRITON = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Every backend an op can run on this machine; the torch reference on contiguous inputs is the expectation.
BACKENDS = ["torch"] + (["triton"] if TRITON else [])
INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def backend_params(backends: Sequence[str] = None):
    """``pytest.param`` per backend; kernel backends carry the ``triton`` mark (skipped where they cannot run)."""
    out = []
    for name in backends or ("torch", "triton"):
        marks = [pytest.mark.triton] if name == "triton" else []
        if name != "torch" and torch.cuda.is_available():
            # The problems are drawn as CPU tensors, which kernels run only in the interpreter; on a GPU the kernels'
            # agreement in every layout is tested by test_strides.py and the ops' own test files.
            marks.append(pytest.mark.skip(reason="the property suite runs kernels in the CPU interpreter"))
        out.append(pytest.param(name, marks=marks, id=name))
    return out


# ----------------------------------------------------------------------------------------------- layouts
# A layout gives a tensor holding the *same values* as a contiguous one in another memory layout: the op must give
# the same answer on it. ``junk`` (same shape, valid values that differ) fills the parts of a wider buffer the view
# leaves out, so a kernel that reads the view as if it were contiguous reads other valid values and answers wrongly
# (rather than reading out of bounds).
LAYOUTS = ("contiguous", "offset", "strided", "column", "wide_rows", "colmajor")


def relayout(x: torch.Tensor, how: str, junk: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A view of a new buffer with ``x``'s values in layout ``how``:

    * ``contiguous``: a contiguous copy;
    * ``offset``: ``y[1:]`` of a buffer with one extra leading row (contiguous, non-zero storage offset);
    * ``strided``: ``y[::2]`` of a buffer interleaving ``x``'s rows with junk rows (a sliced batch);
    * ``column``: ``y[..., 0]`` of ``[..., 2]`` (every stride doubled; for a ``[B]`` tensor, ``y[:, 0]``);
    * ``wide_rows``: ``y[..., :n]`` of a buffer with a wider last dim (inner stride 1, padded rows);
    * ``colmajor``: ``x.transpose(0, -1).contiguous().transpose(0, -1)`` (a column-major table);
    * ``expanded``: ``x[:1].expand_as(x)`` -- a stride-0 batch (changes the values unless every row is equal; the
      callers use it only where the first row stands for every row).
    """
    if junk is None:
        junk = _default_junk(x)
    if how == "contiguous":
        return x.clone().contiguous()
    if how == "offset":
        lead = junk[:1] if junk.shape[0] else torch.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype)
        return torch.cat([lead, x])[1:]
    if how == "strided":
        return torch.stack([x, junk], 1).flatten(0, 1)[::2]
    if how == "column":
        return torch.stack([x, junk], -1)[..., 0]
    if how == "wide_rows":
        return torch.cat([x, junk], -1)[..., : x.shape[-1]]
    if how == "colmajor":
        if x.dim() < 2:
            return torch.stack([x, junk], -1)[..., 0]
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if how == "expanded":
        return x[:1].expand_as(x)
    raise ValueError(how)


def _default_junk(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.bool:
        return ~x
    if x.dtype.is_floating_point:
        return torch.where(torch.isfinite(x), -x + 0.5, torch.zeros_like(x))
    return x.flip(0) if x.shape[0] > 1 else x + 1


def layouts(options: Sequence[str] = LAYOUTS) -> st.SearchStrategy:
    # "contiguous" first: hypothesis shrinks toward it, so a layout in a minimal example is a layout that matters.
    return st.sampled_from(tuple(options))


# ----------------------------------------------------------------------------------------------- trees
@st.composite
def trees(draw, B: int, T: int, dtype=None, ragged: bool = True, garbage_padding: bool = True, n_dtype=None):
    """``(parents [B, T], num_nodes [B])``: random valid trees (node i's parent uniform in ``[0, i)``: stars, chains
    and everything between), ragged ``num_nodes``, padding entries arbitrary (the contract ignores them); int32 or
    int64 each unless given."""
    dtype = dtype or draw(st.sampled_from(INT_DTYPES))
    n_dtype = n_dtype or draw(st.sampled_from(INT_DTYPES))
    rows, ns = [], []
    for _ in range(B):
        n = draw(st.integers(1, T)) if ragged else T
        shape = draw(st.sampled_from(["random", "chain", "star"]))
        row = [-1]
        for i in range(1, n):
            row.append(draw(st.integers(0, i - 1)) if shape == "random" else (i - 1 if shape == "chain" else 0))
        for i in range(n, T):
            row.append(draw(st.integers(-1, T + 1)) if garbage_padding else 0)
        rows.append(row)
        ns.append(n)
    parents = torch.tensor(rows, dtype=dtype).reshape(B, T)
    return parents, torch.tensor(ns, dtype=n_dtype).reshape(B)


def star_like(parents: torch.Tensor) -> torch.Tensor:
    """Junk for a parents tensor: a valid tree of the same shape (a star), usually different from ``parents``."""
    out = torch.zeros_like(parents)
    out[..., 0] = -1
    return out


# ----------------------------------------------------------------------------------------------- naive oracles
def naive_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    B, T = parents.shape
    out = torch.zeros(B, T, dtype=torch.int32)
    for b in range(B):
        for i in range(1, int(num_nodes[b])):
            out[b, i] = out[b, int(parents[b, i])] + 1
    return out


def naive_ancestors(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    B, T = parents.shape
    mask = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for i in range(int(num_nodes[b])):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = int(parents[b, j]) if j > 0 else -1
    return mask


# ----------------------------------------------------------------------------------------------- errors
def assert_rejects(fn: Callable, names, *args, **kwargs) -> Exception:
    """``fn(*args, **kwargs)`` must raise ``ValueError`` or ``TypeError`` whose message names the offending argument
    (one of ``names``): never another exception type, never success."""
    names = (names,) if isinstance(names, str) else tuple(names)
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        assert any(n in msg for n in names), f"{type(exc).__name__} does not name {' / '.join(names)}: {msg!r}"
        return exc
    except Exception as exc:  # noqa: BLE001 - the property is about the exception type
        pytest.fail(f"expected ValueError/TypeError naming {' / '.join(names)}, got {type(exc).__name__}: {exc}")
    pytest.fail(f"expected ValueError/TypeError naming {' / '.join(names)}, but the call returned")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


seeds = st.integers(0, 2**31 - 1)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    """Float comparison with tolerances for the computation's dtype."""
    tol = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), atol=tol[0], rtol=tol[1], equal_nan=False,
                               msg=lambda m: f"{msg}\n{m}")


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact equality including NaN payloads and the sign of zero (compares the raw bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


INF = math.inf


_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``|got - want|`` in units of the larger of the two values' last place in their (shared) float dtype, as fp64
    (0 where equal, inf where only one is NaN); callers take ``.max()``, so an empty input gives ``[0.]``."""
    if want.numel() == 0:
        return torch.zeros(1, dtype=torch.float64)
    bits = _MANTISSA_BITS[want.dtype]
    tiny = torch.finfo(want.dtype).tiny
    g, w = got.double(), want.double()

    def ulp(v):
        _, e = torch.frexp(v.abs().clamp_min(tiny))
        return torch.ldexp(torch.ones_like(v), (e - 1 - bits).to(torch.int64))

    diff = (g - w).abs() / torch.maximum(ulp(g), ulp(w))
    same = (g == w) | (g.isnan() & w.isnan())
    return torch.where(same, torch.zeros_like(diff), torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff))
