"""Property tests (hypothesis) of the token-tree utilities: ``validate_tree``, ``tree_depths``, ``tree_positions``,
``tree_ancestor_mask``, ``tree_ancestor_mask_packed``, ``pack_tree_mask``, ``unpack_tree_mask``, ``chain_parents``.

Valid problems: random trees (ragged ``num_nodes``, garbage padding, int32/int64, B = 0.., T = 1..40 so the packed
mask spans two words and bit 31), in every layout of :mod:`strategies`; results must equal naive loops and the
contiguous layout's. Invalid problems must raise ValueError/TypeError naming the argument.
Long run: ``TLT_HYPOTHESIS_PROFILE=long python -m pytest -q tests/ops/test_properties_tree.py``.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tlt_kernels as tlt
from tlt_kernels.tree import depths_from_ancestor_mask
from strategies import (INT_DTYPES, assert_rejects, budget, layouts, naive_ancestors, naive_depths, relayout, star_like,
                        trees)


@st.composite
def tree_problems(draw, max_B=4, max_T=40):
    B = draw(st.integers(0, max_B))
    T = draw(st.integers(1, max_T))
    parents, n = draw(trees(B, T))
    n = n.to(draw(st.sampled_from(INT_DTYPES)))
    return parents, n


@budget(40)
@given(tree_problems(), layouts(), layouts(), st.booleans())
def test_tree_utilities_match_naive_loops_in_every_layout(problem, par_layout, n_layout, pass_n):
    parents, n = problem
    B, T = parents.shape
    want_depth = naive_depths(parents, n)
    want_mask = naive_ancestors(parents, n)
    par_v = relayout(parents, par_layout, star_like(parents))
    n_v = relayout(n, n_layout, torch.full_like(n, T)) if pass_n else None
    if not pass_n:  # num_nodes None = every node valid: only a tree without padding qualifies
        par_v = relayout(_full_tree(parents, n), par_layout, star_like(parents))
        full = torch.full((B,), T, dtype=torch.int32)
        want_depth, want_mask = naive_depths(par_v.contiguous(), full), naive_ancestors(par_v.contiguous(), full)

    got_n = tlt.validate_tree(par_v, n_v)
    assert got_n.dtype == torch.int32 and got_n.shape == (B,)
    assert torch.equal(got_n, n.to(torch.int32) if pass_n else torch.full((B,), T, dtype=torch.int32))

    depth = tlt.tree_depths(par_v, n_v)
    assert depth.dtype == torch.int32 and torch.equal(depth, want_depth), (depth, want_depth)

    mask = tlt.tree_ancestor_mask(par_v, n_v)
    assert mask.dtype == torch.bool and torch.equal(mask, want_mask)

    packed = tlt.tree_ancestor_mask_packed(par_v, n_v)
    assert packed.dtype == torch.int32 and packed.shape == (B, T, (T + 31) // 32)
    assert torch.equal(tlt.unpack_tree_mask(packed, T), want_mask)
    assert torch.equal(tlt.pack_tree_mask(want_mask), packed)
    assert torch.equal(depths_from_ancestor_mask(packed), want_depth)  # forward_tree's positions read it

    ctx = torch.arange(B, dtype=torch.int32) * 7
    pos = tlt.tree_positions(par_v, relayout(ctx, n_layout), n_v)
    assert torch.equal(pos, ctx.unsqueeze(1) + want_depth)


def _full_tree(parents, n):
    """``parents`` with its padding replaced by children of the root (a valid tree of all T nodes)."""
    out = parents.clone()
    T = parents.shape[1]
    for b in range(parents.shape[0]):
        out[b, int(n[b]):] = 0
    if T:
        out[:, 0] = -1
    return out


@budget(40)
@given(st.integers(0, 3), st.integers(0, 5), st.integers(0, 70), st.integers(0, 2**31 - 1), layouts())
def test_pack_unpack_round_trip(B, R, C, seed, layout):
    """Any bool mask (not only ancestor masks) survives pack -> unpack, bit 31 included, in every layout."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, R, C, generator=g) < 0.5
    packed = tlt.pack_tree_mask(relayout(mask, layout) if B else mask)
    assert packed.dtype == torch.int32 and packed.shape == (B, R, (C + 31) // 32)
    assert torch.equal(tlt.unpack_tree_mask(relayout(packed, layout) if B else packed, C), mask)
    # Bit j % 32 of word j // 32.
    for b, r, c in mask.nonzero().tolist()[:8]:
        assert (int(packed[b, r, c // 32]) >> (c % 32)) & 1 == 1


@given(st.integers(0, 4), st.integers(1, 40))
def test_chain_parents_is_a_valid_chain(B, T):
    par = tlt.chain_parents(B, T)
    assert par.dtype == torch.int32 and par.shape == (B, T)
    tlt.validate_tree(par)
    assert torch.equal(tlt.tree_depths(par), torch.arange(T, dtype=torch.int32).expand(B, T))


# ----------------------------------------------------------------------------------------------- invalid problems
def _bad_parent_value(parents, n, kind):
    """A copy of ``parents`` with one live entry broken."""
    p = parents.clone()
    b = 0
    if kind == "root":
        p[b, 0] = 0
    elif kind == "self":
        p[b, int(n[b]) - 1] = int(n[b]) - 1
    elif kind == "later":
        p[b, int(n[b]) - 1] = int(n[b])
    else:  # negative parent below the root
        p[b, int(n[b]) - 1] = -1
    return p


@budget(10)
@given(st.data())
@pytest.mark.parametrize("kind", ["root", "self", "later", "negative"])
def test_validate_tree_names_parents_for_bad_values(kind, data):
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(2, 9))
    parents, n = data.draw(trees(B, T))
    if kind != "root":
        n[0] = max(int(n[0]), 2)
        parents[0, 1:int(n[0])] = torch.arange(int(n[0]) - 1)
    assert_rejects(tlt.validate_tree, "parents", _bad_parent_value(parents, n, kind), n)


INVALID_TREE_CALLS = {
    # name in the message, description, call(parents, n)
    "parents dtype": ("parents", lambda p, n, f: f(p.float(), n)),
    "parents 1-D": ("parents", lambda p, n, f: f(p[0], None)),
    "parents 3-D": ("parents", lambda p, n, f: f(p.unsqueeze(0), None)),
    "parents not a tensor": ("parents", lambda p, n, f: f(p.tolist(), n)),
    "num_nodes dtype": ("num_nodes", lambda p, n, f: f(p, n.float())),
    "num_nodes shape": ("num_nodes", lambda p, n, f: f(p, torch.cat([n, n]))),
    "num_nodes 2-D": ("num_nodes", lambda p, n, f: f(p, n.unsqueeze(0))),
    "num_nodes device": ("num_nodes", lambda p, n, f: f(p, n.to("meta"))),
}
TREE_FUNCS = {
    "validate_tree": tlt.validate_tree,
    "tree_depths": tlt.tree_depths,
    "tree_ancestor_mask": tlt.tree_ancestor_mask,
    "tree_ancestor_mask_packed": tlt.tree_ancestor_mask_packed,
    "tree_positions": lambda p, n: tlt.tree_positions(
        p, torch.zeros(p.shape[0] if isinstance(p, torch.Tensor) and p.dim() else 1, dtype=torch.int32), n),
}


@budget(3)
@given(st.data())
@pytest.mark.parametrize("case", list(INVALID_TREE_CALLS))
@pytest.mark.parametrize("func", list(TREE_FUNCS))
def test_tree_utilities_reject_bad_metadata(func, case, data):
    """Dtype / shape / device errors (metadata only, no host sync needed) name the argument, in every utility."""
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 9))
    parents, n = data.draw(trees(B, T))
    name, call = INVALID_TREE_CALLS[case]
    assert_rejects(call, name, parents, n, TREE_FUNCS[func])


@budget(5)
@given(st.data())
def test_validate_tree_names_num_nodes_out_of_range(data):
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 9))
    parents, n = data.draw(trees(B, T))
    b = data.draw(st.integers(0, B - 1))
    n[b] = data.draw(st.sampled_from([0, -1, T + 1, 2**31 - 1]))
    assert_rejects(tlt.validate_tree, "num_nodes", parents, n)


def test_validate_tree_names_parents_for_zero_nodes():
    assert_rejects(tlt.validate_tree, "parents", torch.zeros(2, 0, dtype=torch.int32))


@pytest.mark.parametrize("bad", [
    ("mask", lambda m: tlt.pack_tree_mask(m.to(torch.int32))),
    ("mask", lambda m: tlt.pack_tree_mask(m[0])),
    ("mask", lambda m: tlt.pack_tree_mask(m.tolist())),
    ("packed", lambda m: tlt.unpack_tree_mask(tlt.pack_tree_mask(m).to(torch.int64), 5)),
    ("packed", lambda m: tlt.unpack_tree_mask(tlt.pack_tree_mask(m)[0], 5)),
    ("num_cols", lambda m: tlt.unpack_tree_mask(tlt.pack_tree_mask(m), -1)),
    ("num_cols", lambda m: tlt.unpack_tree_mask(tlt.pack_tree_mask(m), 33)),  # more columns than the words hold
    ("num_cols", lambda m: tlt.unpack_tree_mask(tlt.pack_tree_mask(m), 2.5)),
], ids=["mask-dtype", "mask-2d", "mask-list", "packed-dtype", "packed-2d", "num_cols-negative", "num_cols-too-many",
        "num_cols-float"])
def test_pack_unpack_reject_bad_arguments(bad):
    name, call = bad
    assert_rejects(call, name, torch.rand(2, 5, 5) < 0.5)


@pytest.mark.parametrize("name,args", [("batch", (-1, 3)), ("num_nodes", (2, 0)), ("batch", (2.0, 3)),
                                       ("num_nodes", (2, -1))], ids=["batch<0", "nodes=0", "batch-float", "nodes<0"])
def test_chain_parents_rejects_bad_sizes(name, args):
    assert_rejects(tlt.chain_parents, name, *args)


def test_one_node_trees_take_one_launch_and_match_the_general_rule():
    """A plain decoding step's tree (T = 1) is the root alone: depth 0 and a mask that sees itself (nothing for a
    padding root, num_nodes = 0, as the general rule gives), from one launch each rather than a round of jumps (the
    engine's plain step builds both every step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Launches(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.count += 1
            return func(*args, **(kwargs or {}))

    parents = torch.full((3, 1), -1, dtype=torch.int32)
    for n in (torch.tensor([1, 0, 1], dtype=torch.int32), None):
        full = torch.ones(3, dtype=torch.int32) if n is None else n
        with Launches() as depth_launches:
            depth = tlt.tree_depths(parents, n)
        with Launches() as mask_launches:
            packed = tlt.tree_ancestor_mask_packed(parents, n)
        assert depth.dtype == torch.int32 and torch.equal(depth, naive_depths(parents, full))
        with Launches() as from_mask_launches:  # forward_tree reads the depths off the plan's mask
            from_mask = depths_from_ancestor_mask(tlt.tree_ancestor_mask_packed(parents, n))
        assert torch.equal(from_mask, depth)
        assert packed.dtype == torch.int32 and packed.shape == (3, 1, 1)
        assert torch.equal(tlt.unpack_tree_mask(packed, 1), naive_ancestors(parents, full))
        # 1 and 2 launches (19 and 14 before); with num_nodes None, resolve_num_nodes makes the count: one more
        assert depth_launches.count <= (2 if n is None else 1)
        assert mask_launches.count <= (3 if n is None else 2)
        assert from_mask_launches.count <= (4 if n is None else 3)  # the mask's launches and one
