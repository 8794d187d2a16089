"""Every public op gives the same result for any layout of its inputs.

Each tensor argument of each op is replaced, one at a time, by a non-contiguous tensor holding the same values:
a column of a wider tensor, a tensor with a stride-2 last dimension, a transposed-then-transposed (column-major)
table, an expanded (stride-0) vector. The storage between the wanted values holds other *valid* values (another
request's), so a kernel that reads the view as if it were contiguous produces a plausible, wrong answer instead of
crashing: exactly the silent failure this file exists to catch. Every backend is compared against itself on the
contiguous layout (the agreement across backends is checked elsewhere). A KV cache, written in place, may instead be
refused with a ValueError that names it.
"""
from typing import Callable, Dict, List

import pytest
import torch
from conftest import HAS_CUDA, TRITON_INTERPRET, kernel_devices

import tlt_kernels as tlt
from tlt_kernels._backend import cuda_extension_available

DEVICE = kernel_devices()[0]


def _junk(t: torch.Tensor) -> torch.Tensor:
    """Other valid values of the same shape: another request's (rows reversed), or the tensor itself."""
    return t.flip(0) if t.dim() and t.shape[0] > 1 else t.clone()


def column(t: torch.Tensor) -> torch.Tensor:
    """``t`` as every other row of a wider tensor (non-unit stride on dim 0)."""
    return torch.stack([t, _junk(t)], dim=1)[:, 0] if t.dim() else t


def stride2(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a stride-2 last dimension."""
    return torch.stack([t, _junk(t)], dim=-1)[..., 0] if t.dim() else t


def column_major(t: torch.Tensor) -> torch.Tensor:
    """A 2-D ``t`` laid out column-major (a transposed-then-transposed table)."""
    return t.t().contiguous().t()


def expanded(t: torch.Tensor) -> torch.Tensor:
    """A 1-D ``t`` whose values are all ``t[0]``, as a stride-0 view; the storage behind it holds junk."""
    storage = torch.cat([t[:1], _junk(t)[1:] + 1])
    return storage[:1].expand(t.shape[0])


def _layouts(t: torch.Tensor) -> Dict[str, Callable]:
    out = {}
    if t.dim() >= 1 and t.shape[0] > 1:
        out["column"] = column
    if t.dim() >= 1 and t.shape[-1] > 1:
        out["stride2"] = stride2
    if t.dim() == 2 and min(t.shape) > 1:
        out["column_major"] = column_major
    return out


def _backends(op: str) -> List[str]:
    names = ["torch"]
    if HAS_CUDA or TRITON_INTERPRET:
        names.append("triton")
    if HAS_CUDA and cuda_extension_available() and op in ("verify_tree", "compact_kv", "build_draft_tree", "tree_attention"):
        names.append("cuda")
    return names


# --- the problems: (kwargs, call) with every tensor argument a keyword --------------------------------------------

def _verify_problem(gen):
    B, T, V = 8, 5, 17  # eight requests with different parameters: swapping two requests' values changes the outcome
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 1], [-1, 0, 1, 1, 0]] * 2, dtype=torch.int32)
    kw = dict(
        logits=torch.randn(B, T, V, generator=gen) * 0.7,
        draft_tokens=torch.randint(0, V, (B, T), generator=gen),
        parents=parents,
        num_nodes=torch.tensor([5, 3, 4, 5, 2, 5, 1, 4], dtype=torch.int32),
        draft_probs=torch.softmax(torch.randn(B, T, V, generator=gen) * 3, -1),
        temperature=torch.tensor([0.7, 0.0, 1.3, 2.0, 0.5, 1.0, 0.9, 3.0]),
        top_k=torch.tensor([0, 3, 5, 2, 0, 8, 1, 4], dtype=torch.int32),
        top_p=torch.tensor([0.9, 1.0, 0.5, 0.3, 0.8, 1.0, 0.6, 0.2]),
        seed=torch.arange(11, 11 + B),
        offset=torch.tensor([0, 5, 7, 1, 2, 3, 9, 4]),
    )
    # Half the drafts are the target's favourites after their parent: walks go deeper than the root.
    favourite = kw["logits"].gather(1, parents[:, 1:].long().unsqueeze(-1).expand(B, T - 1, V)).argmax(-1)
    kw["draft_tokens"][::2, 1:] = favourite[::2]
    return kw, lambda backend, **a: tuple(tlt.verify_tree(**a, return_stats=True, backend=backend))


def _compact_problem(gen):
    num_blocks, block_size, hkv, dim = 10, 4, 2, 8
    kw = dict(
        k_cache=torch.randn(num_blocks, block_size, hkv, dim, generator=gen),
        v_cache=torch.randn(num_blocks, block_size, hkv, dim, generator=gen),
        block_table=torch.tensor([[3, 1, 7], [0, 2, 5], [9, 8, 6]], dtype=torch.int32),
        context_lens=torch.tensor([2, 5, 0], dtype=torch.int32),
        # Paths that stay valid when two requests swap any one argument (the sensitivity check swaps them).
        accepted_nodes=torch.tensor([[0, 2, 4, 5], [0, 1, 3, 5], [0, 3, 4, 6]], dtype=torch.int32),
        num_accepted=torch.tensor([2, 3, 1], dtype=torch.int32),
    )

    def call(backend, **a):
        k, v = a["k_cache"], a["v_cache"]
        new_lens = tlt.compact_kv(**a, backend=backend)
        return new_lens, k.clone(), v.clone()

    return kw, call


def _build_problem(gen):
    B, N = 3, 12
    par = torch.full((B, N), -1, dtype=torch.int32)
    for c in range(1, N):
        par[:, c] = torch.randint(-1, c, (B,), generator=gen, dtype=torch.int32)
    scores = -torch.rand(B, N, generator=gen) * 5
    scores[1, 4] = float("-inf")
    kw = dict(
        cand_parents=par,
        cand_tokens=torch.randint(0, 100, (B, N), generator=gen),
        cand_scores=scores,
        root_tokens=torch.tensor([7, 8, 9]),
    )
    return kw, lambda backend, **a: tuple(t for t in tlt.build_draft_tree(**a, num_verify=6, return_mask=True, backend=backend))


def _ngram_problem(gen, tree: bool):
    B, L = 3, 24
    tokens = torch.randint(0, 4, (B, L), generator=gen)  # a small alphabet: many matches
    kw = dict(tokens=tokens, lengths=torch.tensor([24, 13, 7], dtype=torch.int32))
    if tree:
        return kw, lambda backend, **a: tuple(tlt.ngram_propose_tree(**a, k=3, num_branches=2, backend=backend))
    return kw, lambda backend, **a: tuple(tlt.ngram_propose(**a, k=3, backend=backend))


def _attention_problem(gen, dtype):
    B, T, Hq, Hkv, D, block_size, num_blocks = 3, 4, 2, 1, 64, 8, 12  # head_dim: one the kernels take
    kw = dict(
        q=torch.randn(B, T, Hq, D, generator=gen).to(dtype),
        k_cache=torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype),
        v_cache=torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype),
        block_table=torch.tensor([[4, 1, 7, 0], [2, 3, 5, 6], [11, 10, 9, 8]], dtype=torch.int32),
        context_lens=torch.tensor([13, 20, 3], dtype=torch.int32),
        parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0]], dtype=torch.int32),
        num_nodes=torch.tensor([4, 2, 3], dtype=torch.int32),
    )
    return kw, lambda backend, **a: (tlt.tree_attention(**a, backend=backend),)


def _problem(op: str, backend: str):
    gen = torch.Generator().manual_seed(7)
    if op == "verify_tree":
        return _verify_problem(gen)
    if op == "compact_kv":
        return _compact_problem(gen)
    if op == "build_draft_tree":
        return _build_problem(gen)
    if op in ("ngram_propose", "ngram_propose_tree"):
        return _ngram_problem(gen, tree=op == "ngram_propose_tree")
    # The CUDA kernel reads half precision only; the interpreter computes bf16 as zeros.
    return _attention_problem(gen, torch.bfloat16 if backend == "cuda" else torch.float32)


IN_PLACE = {"k_cache", "v_cache"}
ARGS = {
    "verify_tree": ["logits", "draft_tokens", "parents", "num_nodes", "draft_probs", "temperature", "top_k", "top_p", "seed", "offset"],
    "compact_kv": ["k_cache", "v_cache", "block_table", "context_lens", "accepted_nodes", "num_accepted"],
    "build_draft_tree": ["cand_parents", "cand_tokens", "cand_scores", "root_tokens"],
    "ngram_propose": ["tokens", "lengths"],
    "ngram_propose_tree": ["tokens", "lengths"],
    "tree_attention": ["q", "k_cache", "v_cache", "block_table", "context_lens", "parents", "num_nodes"],
}
CASES = [(op, arg) for op, args in ARGS.items() for arg in args]


def _on_device(kw):
    return {name: t.to(DEVICE) for name, t in kw.items()}


def _fresh(kw):
    return {name: t.clone() for name, t in kw.items()}


def _assert_same(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}: output {i}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}: output {i}"
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: output {i}: {m}")


def _run_layout(call, backend, kw, arg, layout_name, layout, want):
    inputs = _fresh(kw)
    inputs[arg] = layout(inputs[arg])
    assert not inputs[arg].is_contiguous()
    what = f"{arg} as {layout_name} (strides {inputs[arg].stride()})"
    if arg in IN_PLACE:
        try:
            got = call(backend, **inputs)
        except ValueError as exc:  # refusing a non-contiguous in-place cache is allowed; it must say which
            assert arg in str(exc), str(exc)
            return
    else:
        got = call(backend, **inputs)
    _assert_same(got, want, what)


def _differs(got, want) -> bool:
    return any(not (g is None or torch.equal(g.cpu().nan_to_num(), w.cpu().nan_to_num())) for g, w in zip(got, want))


@pytest.mark.triton
@pytest.mark.parametrize("op,arg", CASES, ids=[f"{op}-{arg}" for op, arg in CASES])
def test_views_read_as_their_values(op, arg):
    for backend in _backends(op):
        kw, call = _problem(op, backend)
        kw = _on_device(kw)
        want = call(backend, **_fresh(kw))
        if backend == "torch":  # the problem must depend on the argument (other requests' values change it), or a
            swapped = _fresh(kw)  # misread could go unseen; a property of the problem, so checked once
            swapped[arg] = _junk(swapped[arg])
            assert _differs(call(backend, **swapped), want), f"{op}'s output does not depend on {arg}: the test is blind"
        for layout_name, layout in _layouts(kw[arg]).items():
            _run_layout(call, backend, kw, arg, layout_name, layout, want)


EXPANDABLE = [("verify_tree", a) for a in ("num_nodes", "temperature", "top_k", "top_p", "seed", "offset")] + [
    ("compact_kv", "context_lens"), ("compact_kv", "num_accepted"), ("build_draft_tree", "root_tokens"),
    ("ngram_propose", "lengths"), ("ngram_propose_tree", "lengths"),
    ("tree_attention", "context_lens"), ("tree_attention", "num_nodes"),
]


# The broadcast value, where request 1's would not do (greedy makes top-k/top-p moot; 3 drafts leave row 0's path).
UNIFORM = {("verify_tree", "temperature"): 0.7, ("compact_kv", "num_accepted"): 1}


@pytest.mark.triton
@pytest.mark.parametrize("op,arg", EXPANDABLE, ids=[f"{op}-{arg}" for op, arg in EXPANDABLE])
def test_expanded_per_request_values(op, arg):
    """A per-request vector passed as one value broadcast over the batch (stride 0)."""
    for backend in _backends(op):
        kw, call = _problem(op, backend)
        kw[arg] = torch.full_like(kw[arg], UNIFORM.get((op, arg), kw[arg][1].item()))
        kw = _on_device(kw)
        want = call(backend, **_fresh(kw))
        _run_layout(call, backend, kw, arg, "expanded", expanded, want)
