"""Fused Triton verify_tree: bit-exact Philox, the kernel's paths against the reference (its agreement test over every
backend is test_verify_tree.py's first), error flags, distribution.

On the CPU these run in the Triton interpreter (slow per op), so batches are tiny there; the GPU
runs the full-size Monte Carlo.
"""
import numpy as np
import pytest
import torch

from conftest import HAS_CUDA, compile_for_sm90, kernel_devices, poison_
from test_verify_tree import (ALPHA, CHAIN, MC_B, TREE, biased, chi2_pvalue, compare_outputs, empty_batch_call,
                              monte_carlo_first_two, verify_inputs)
from tlt_kernels import verify_tree

pytestmark = pytest.mark.triton
DEV = kernel_devices()[0]


def _tri():
    from tlt_kernels._triton import verify_tree as tv

    return tv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_and_multi_tile(dtype):
    # block_size 16 over V = 45 exercises several tiles and a ragged last tile.
    B, V = 3, 45
    lg, toks, par, q = verify_inputs(B, len(TREE), V, TREE, seed=3, use_q=True, dtype=dtype)
    kw = dict(temperature=0.8, top_k=9, top_p=0.85)
    ref = verify_tree(lg, toks, par, draft_probs=q.to(dtype), seed=torch.arange(B), return_stats=True, backend="torch", **kw)
    tv = _tri()
    n = torch.full((B,), len(TREE), dtype=torch.int32)
    temp, k, p = torch.full((B,), 0.8), torch.full((B,), 9, dtype=torch.int32), torch.full((B,), 0.85)
    out = tv._launch(*(t.to(DEV) for t in (lg, toks, par, n, q.to(dtype), temp, k, p, torch.arange(B), torch.zeros(B, dtype=torch.int64))),
                     max_depth=len(TREE) - 1, return_stats=True, block_size=16)
    compare_outputs(ref, out)


def test_poisoned_outputs_fully_written_and_padding():
    B, T, V = 4, len(TREE), 11
    lg, toks, par, q = verify_inputs(B, T, V, TREE, seed=9, use_q=True)
    n = torch.tensor([1, 3, 5, 7], dtype=torch.int32)
    for b in range(B):
        lg[b, n[b]:] = float("nan")  # padding is never read
        toks[b, n[b]:] = -7
    max_depth = 4
    out = tuple(poison_(torch.empty(shape, dtype=torch.int32, device=DEV)) for shape in ((B, max_depth + 1), (B,), (B, max_depth + 1), (B,), (B, max_depth, 2)))
    seeds = torch.arange(B)
    tv = _tri()
    args = (lg, toks, par, n, q, torch.full((B,), 1.0), None, None, seeds, torch.zeros(B, dtype=torch.int64))
    tv._launch(*(None if t is None else t.to(DEV) for t in args), max_depth=max_depth, return_stats=True, out=out)
    for t in out:
        assert not (t == -12345).any()
    ref = verify_tree(lg, toks, par, num_nodes=n, draft_probs=q, temperature=1.0, seed=seeds, max_depth=max_depth, return_stats=True)
    compare_outputs(ref, out)


def _random_case(g):
    """One random verification problem: random trees (ragged ``num_nodes``), vocabularies down to 1, logit scales
    from 0.1 to 30 with -inf entries, drafts that are often the parent row's argmax, and per-request sampling
    parameters mixing greedy, tiny and large temperatures, top-k at and past V and top-p from 1e-6 to 1."""
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    pick = lambda xs: xs[ri(0, len(xs) - 1)]  # noqa: E731
    B, T, V = ri(1, 4), ri(1, 7), pick([1, 2, 3, 5, 17, 64])
    par = torch.full((B, T), -1, dtype=torch.int32)
    for t in range(1, T):
        par[:, t] = (torch.rand(B, generator=g) * t).to(torch.int32)
    num_nodes = torch.randint(1, T + 1, (B,), generator=g, dtype=torch.int32)
    lg = torch.randn(B, T, V, generator=g) * pick([0.1, 1.0, 5.0, 30.0])
    if ri(0, 2) == 0:
        lg[..., 1:] = lg[..., 1:].masked_fill(lg[..., 1:] < -1, float("-inf"))  # column 0 keeps every row finite
    toks = torch.randint(0, V, (B, T), generator=g)
    argmax_of_parent = lg.argmax(-1).gather(1, par.clamp(min=0).to(torch.int64))
    toks = torch.where(torch.rand(B, T, generator=g) < 0.5, argmax_of_parent, toks)
    q = torch.softmax(lg.clamp(min=-50) + torch.randn(B, T, V, generator=g), -1) if V > 1 and ri(0, 1) else None
    kw = {}
    if ri(0, 3):
        kw["temperature"] = torch.tensor([pick([0.0, 1e-3, 0.7, 1.0, 3.0]) for _ in range(B)])
        if ri(0, 1):
            kw["top_k"] = torch.tensor([pick([0, 1, 2, V, V + 5]) for _ in range(B)], dtype=torch.int32)
        if ri(0, 1):
            kw["top_p"] = torch.tensor([pick([1e-6, 0.3, 0.9, 1.0]) for _ in range(B)])
    kw.update(num_nodes=num_nodes, draft_probs=q, seed=torch.randint(0, 1000, (B,), generator=g),
              offset=torch.randint(0, 5, (B,), generator=g), return_stats=True)
    return lg, toks, par, kw


def test_random_cases_same_as_reference():
    """40 random problems (trees, vocabularies, -inf, every rule and parameter mix) give the reference's outputs.
    The interpreter matches exactly; on a GPU at most one request of all may differ (a float tie at a decision
    boundary: the kernel accumulates in fp32, the reference in float64)."""
    g = torch.Generator().manual_seed(11)
    differing, requests = 0, 0
    for _ in range(40):
        lg, toks, par, kw = _random_case(g)
        ref = verify_tree(lg, toks, par, backend="torch", **kw)
        dev_kw = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        got = verify_tree(lg.to(DEV), toks.to(DEV), par.to(DEV), backend="triton", **dev_kw)
        same = torch.ones(lg.shape[0], dtype=torch.bool)
        for x, y in zip(ref, got):
            if x is None:  # an output not asked for
                assert y is None
                continue
            same &= (x == y.cpu()).flatten(1).all(1) if x.dim() > 1 else x == y.cpu()
        differing += int((~same).sum())
        requests += lg.shape[0]
    assert differing <= (1 if str(DEV).startswith("cuda") else 0), f"{differing} of {requests} requests differ from the reference"


def test_error_flags_are_per_request():
    B, T, V = 5, len(CHAIN), 9
    lg, toks, par, _ = verify_inputs(B, T, V, CHAIN, seed=4, use_q=False)
    toks[:, 1] = lg[:, 0].argmax(-1)  # node 1 always accepted (greedy)
    bad = lg.clone()
    bad[0, 0, 3] = float("nan")  # root row NaN
    bad[1, 1, 0] = float("inf")  # accepted row +inf
    bad[2, 0] = float("-inf")  # root row all -inf
    bad[3, 4] = float("nan")  # node 4: visited only if the walk gets there
    toks_bad = toks.clone()
    toks_bad[4, 2] = V + 3  # out-of-range token, reached after node 1 is accepted
    kw = dict(seed=torch.arange(B), return_stats=True)
    got = verify_tree(bad.to(DEV), toks_bad.to(DEV), par.to(DEV), backend="triton", validate=False, **{**kw, "seed": kw["seed"].to(DEV)})
    err = got.error.cpu().tolist()
    assert err[:3] == [1, 1, 1] and err[4] == 1
    for b in (0, 1, 2, 4):
        assert got.num_accepted[b] == 0
        assert (got.tokens[b] == -1).all()
        assert got.accepted_nodes[b].tolist() == [0] + [-1] * (T - 1)
        assert (got.stats[b] == 0).all()
    ref = verify_tree(lg[3:4], toks[3:4], par[3:4], seed=torch.tensor([3]), return_stats=True)
    if ref.num_accepted[0] < 4:  # node 4's NaN row was not visited: request 3 is unaffected
        assert err[3] == 0
        compare_outputs(ref, tuple(None if t is None else t[3:4] for t in got))
    else:
        assert err[3] == 1
    # The reference flags the same requests and resets the same outputs (one contract on every backend).
    compare_outputs(verify_tree(bad, toks_bad, par, backend="torch", validate=False, **kw), got)


def test_root_only_and_zero_depth():
    B, V = 3, 7
    lg, toks, par, _ = verify_inputs(B, 1, V, [-1], seed=1, use_q=False)
    for kw in (dict(), dict(temperature=0.8, top_p=0.9)):
        ref = verify_tree(lg, toks, par, seed=torch.arange(B), **kw)
        got = verify_tree(lg.to(DEV), toks.to(DEV), par.to(DEV), seed=torch.arange(B).to(DEV), backend="triton", **kw)
        compare_outputs(ref, got)
    lg, toks, par, _ = verify_inputs(B, len(TREE), V, TREE, seed=2, use_q=False)
    kw = dict(temperature=1.0, seed=torch.arange(B), max_depth=0, validate=False)
    ref = verify_tree(lg, toks, par, **kw)
    got = verify_tree(lg.to(DEV), toks.to(DEV), par.to(DEV), backend="triton", **{**kw, "seed": kw["seed"].to(DEV)})
    compare_outputs(ref, got)
    assert got.tokens.shape == (B, 1) and (got.num_accepted == 0).all()


def test_fake_tensor_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    tv = _tri()
    with FakeTensorMode():
        lg = torch.empty(4, 6, 100)
        toks = torch.empty(4, 6, dtype=torch.int64)
        par = torch.empty(4, 6, dtype=torch.int32)
        n = torch.empty(4, dtype=torch.int32)
        s = torch.empty(4, dtype=torch.int64)
        out = tv._verify_tree_op(lg, toks, par, n, None, torch.empty(4), None, None, s, s, 3, True)
        assert [tuple(t.shape) for t in out] == [(4, 4), (4,), (4, 4), (4,), (4, 3, 2)]
        assert all(t.dtype == torch.int32 for t in out)


def _triton_verify(*args, **kw):
    dev = lambda t: t.to(DEV) if isinstance(t, torch.Tensor) else t  # noqa: E731
    res = verify_tree(*(dev(a) for a in args), backend="triton", **{k: dev(v) for k, v in kw.items()})
    return type(res)(*(None if t is None else t.cpu() for t in res))


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["chain-q-topk-topp", "tree-q-topk", "tree-cand-topk-topp", "tree-q-topp"])
def test_triton_monte_carlo_matches_exact_gpu(case):
    counts, exact, res = monte_carlo_first_two(_triton_verify, case, MC_B)
    assert (res.error == 0).all()
    assert chi2_pvalue(counts, exact) > ALPHA
    bad_counts = np.random.default_rng(1).multinomial(MC_B, biased(exact).ravel())
    assert chi2_pvalue(bad_counts, exact) < ALPHA


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the GPU runs the full-size version")
def test_triton_monte_carlo_interpreter_small():
    """A small chi-square under the interpreter (catches gross errors only; the GPU test has power)."""
    counts, exact, res = monte_carlo_first_two(_triton_verify, "chain-q-t1", 128)
    ref_counts, _, ref = monte_carlo_first_two(verify_tree, "chain-q-t1", 128)
    assert (res.error == 0).all()
    assert torch.equal(res.tokens, ref.tokens)
    assert chi2_pvalue(counts, exact) > ALPHA


@pytest.mark.cuda
def test_cuda_graph_capture_and_torch_compile():
    B, T, V = 64, len(TREE), 32000
    lg, toks, par, q = (t.cuda() if t is not None else None for t in verify_inputs(B, T, V, TREE, seed=5, use_q=True))
    seeds = torch.arange(B, device="cuda")
    offset = torch.zeros(B, dtype=torch.int64, device="cuda")
    kw = dict(draft_probs=q, temperature=0.8, top_p=0.9, offset=offset, backend="triton", return_stats=True)
    eager = verify_tree(lg, toks, par, seed=seeds, **kw)
    static_seed = seeds.clone()
    verify_tree(lg, toks, par, seed=static_seed, validate=False, **kw)  # warm-up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify_tree(lg, toks, par, seed=static_seed, **kw)  # validation is skipped while capturing
    static_seed.copy_(seeds + 1000)
    graph.replay()
    again = verify_tree(lg, toks, par, seed=seeds + 1000, **kw)
    compare_outputs(again, out)
    compiled = torch.compile(lambda l, s: verify_tree(l, toks, par, seed=s, validate=False, **kw))
    compare_outputs(eager, compiled(lg, seeds))


_COMPILE_SM90 = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tlt_kernels._triton import verify_tree as m
names = m._verify_tree_kernel.arg_names
types = (["*bf16", "*fp32", "*i64", "*i32", "*i32", "*fp32", "*i32", "*fp32", "*i64", "*i64", "*fp32"] + ["*i32"] * 5
         + ["*fp32"] + ["i32"] * 9)
from tlt_kernels._triton import ptxas_report
def compile_(num_warps, **consts):
    sig = dict(zip(names, types), **{k: "constexpr" for k in consts})
    src = ASTSource(m._verify_tree_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
flags = dict(HAS_Q=True, HAS_TEMP=True, STATS=True, NODE_BLOCK=16, DEPTH_BLOCK=16)
for scores in (False, True):  # with SCORES the walk also writes the emitted tokens' log-probs
    compile_(4, HAS_TOP_K=True, HAS_TOP_P=True, NUM_TILES=4, BLOCK_SIZE=256, NUM_STREAM_TILES=4, STREAM_BLOCK=256,
             SCORES=scores, **flags)
    # The launcher's V=152064 config without top-k/top-p: 2048-wide streaming tiles, and no register spills.
    c = compile_(8, HAS_TOP_K=False, HAS_TOP_P=False, NUM_TILES=149, BLOCK_SIZE=1024, NUM_STREAM_TILES=75,
                 STREAM_BLOCK=m.STREAM_BLOCK_MAX, SCORES=scores, **flags)
    regs, spills, log = ptxas_report(c.asm["ptx"])  # raises with ptxas's stderr if it fails
    assert spills == 0, f"STREAM_BLOCK_MAX={m.STREAM_BLOCK_MAX}, SCORES={scores}: spills {spills} bytes"
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the full-featured kernel for sm_90."""
    compile_for_sm90(_COMPILE_SM90)


@pytest.mark.cuda
@pytest.mark.parametrize("V", [32000, 152064])
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_gpu_large_vocab_agrees_with_reference(V, top_p):
    """Full-size rows: fp32 kernel vs float64 reference; only rare float ties may differ."""
    B, T = 64, 16
    g = torch.Generator(device="cuda").manual_seed(V)
    lg = (torch.randn(B, T, V, generator=g, device="cuda") * 3).to(torch.bfloat16)
    q = torch.softmax(lg.float() / 0.7 + 0.8 * torch.randn(B, T, V, generator=g, device="cuda"), -1)
    par = torch.div(torch.arange(T, device="cuda") - 1, 2, rounding_mode="floor").to(torch.int32).expand(B, T).contiguous()
    toks = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, T)
    toks = toks.gather(1, par.clamp(min=0).long())  # node i proposes a draw from its parent's row
    kw = dict(draft_probs=q, temperature=0.7, top_k=50, top_p=top_p, seed=torch.arange(B, device="cuda"), return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **kw)
    got = verify_tree(lg, toks, par, backend="triton", **kw)
    assert (got.error == 0).all()
    same = (got.tokens == ref.tokens).all(1).float().mean().item()
    assert same >= 0.97, f"only {same:.3f} of requests match the reference"


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.995, None])
def test_top_p_over_compacted_candidates_matches_reference(top_p):
    """At a vocabulary of thousands with a long tail, the top-p threshold is selected among the compacted
    candidates (weight >= Z (1 - top_p) / 2V) across several tiles: same tokens as the torch reference. Without
    top-p (None) the streaming passes take STREAM_BLOCK_MAX-wide tiles, two over V=3000 (the last one ragged),
    while the radix tile stays 1024."""
    B, V = 4, 3000
    g = torch.Generator().manual_seed(5)
    lg = 3.0 * torch.randn(B, len(CHAIN), V, generator=g)  # peaked: most of V is in the tail
    toks = torch.randint(0, V, (B, len(CHAIN)), generator=g)
    toks[:, 1] = lg[:, 0].argmax(-1)
    par = torch.tensor(CHAIN, dtype=torch.int32).expand(B, len(CHAIN)).contiguous()
    q = torch.softmax(lg + 0.5 * torch.randn(B, len(CHAIN), V, generator=g), -1)
    args = dict(draft_probs=q, temperature=0.7, top_p=top_p, seed=torch.arange(B) * 13 + 1, offset=3, return_stats=True)
    ref = verify_tree(lg, toks, par, backend="torch", **args)
    # The default tile (1024) gives three tiles at V = 3000.
    got = verify_tree(lg.to(DEV), toks.to(DEV), par.to(DEV), backend="triton", **{**args, "draft_probs": q.to(DEV),
                                                                                   "seed": args["seed"].to(DEV)})
    compare_outputs(ref, got)


# ---------------------------------------------------------------------------------------------
# Direct dispatch: plain eager calls launch without the torch.library op; compile and tracing keep the op.
# ---------------------------------------------------------------------------------------------
def _counting_op(monkeypatch, entry):
    calls = []
    real = entry.op

    def op(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(entry, "op", op)
    return calls


def test_eager_call_launches_directly_and_matches_the_custom_op_path(monkeypatch):
    import tlt_kernels._backend as backend

    B, T, V = 3, len(TREE), 37
    lg, toks, par, q = (t.to(DEV) for t in verify_inputs(B, T, V, TREE, seed=11, use_q=True))
    kw = dict(draft_probs=q, temperature=[0.0, 0.8, 1.2], top_p=0.9, seed=torch.arange(B, device=DEV),
              return_stats=True, backend="triton")
    calls = _counting_op(monkeypatch, _tri().verify_tree_triton)
    direct = verify_tree(lg, toks, par, **kw)
    assert calls == [], "a plain eager call must not go through the custom op"
    monkeypatch.setattr(backend, "DIRECT_DISPATCH", False)
    through_op = verify_tree(lg, toks, par, **kw)
    assert calls == [1]
    compare_outputs(direct, through_op)
    assert torch.equal(direct.stats, through_op.stats)


def test_direct_dispatch_only_in_plain_eager(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import tlt_kernels._backend as backend

    x = torch.zeros(3)
    assert backend.direct_dispatch_ok(x, None, [x, x])

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not backend.direct_dispatch_ok(x), "a dispatch mode (tracing, profiling) needs the op"
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not backend.direct_dispatch_ok(x, fake)
    assert not backend.direct_dispatch_ok(x, [x, fake]), "a subclass inside a list of caches counts too"
    w = torch.zeros(3, requires_grad=True)
    assert not backend.direct_dispatch_ok(x, w), "an input that requires grad goes through the op"
    with torch.no_grad():
        assert backend.direct_dispatch_ok(x, w)
    weight = torch.nn.Parameter(torch.zeros(3))  # a model's weight: a Parameter, plain underneath
    assert not backend.direct_dispatch_ok(x, weight), "a trainable weight with grad on goes through the op"
    with torch.no_grad():
        assert backend.direct_dispatch_ok(x, weight), "a model's weights under no_grad launch directly"
    weight.requires_grad_(False)
    assert backend.direct_dispatch_ok(x, weight)
    seen = []

    def probe(t):
        seen.append(backend.direct_dispatch_ok(t))
        return t * 2

    torch.vmap(probe)(torch.zeros(3, 2))
    assert seen == [False], "inside vmap the wrapped tensors look plain: the op must decide"
    seen.clear()
    torch.jit.trace(probe, torch.zeros(2), check_trace=False)
    assert seen == [False], "torch.jit.trace records only what goes through the dispatcher"
    seen.clear()
    probe(x)
    assert seen == [True]
    monkeypatch.setattr(backend, "DIRECT_DISPATCH", False)
    assert not backend.direct_dispatch_ok(x)


def test_compiled_call_goes_through_the_custom_op(monkeypatch):
    B, T, V = 2, len(CHAIN), 29
    lg, toks, par, _ = (t.to(DEV) if t is not None else None for t in verify_inputs(B, T, V, CHAIN, seed=3, use_q=False))
    seeds = torch.arange(B, device=DEV)
    kw = dict(temperature=0.7, top_k=5, validate=False, backend="triton")
    eager = verify_tree(lg, toks, par, seed=seeds, **kw)
    torch._dynamo.reset()
    compiled = torch.compile(lambda l, s: verify_tree(l, toks, par, seed=s, **kw), backend="eager", fullgraph=True)
    calls = _counting_op(monkeypatch, _tri().verify_tree_triton)
    compare_outputs(eager, compiled(lg, seeds))
    assert calls, "under torch.compile the call must stay on the custom op"


def test_empty_batch():
    empty_batch_call("triton", DEV)

