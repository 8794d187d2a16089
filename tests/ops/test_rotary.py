"""apply_rotary: every backend against the torch reference (awkward head dims, q/k as views of one packed qkv
projection, cos/sin expanded over the batch), the reference against transformers' formula, validation,
torch.compile, and a hypothesis property."""
import pytest
import torch
from conftest import HAS_CUDA, agreement_backends, compile_for_sm90, kernel_devices, need_backend
from hypothesis import given, note
from hypothesis import strategies as st
from strategies import FLOAT_DTYPES, assert_rejects, backend_params, budget, gen, seeds

import tlt_kernels
from tlt_kernels import apply_rotary
from tlt_kernels.ops.rotary import _ROTARY


def packed_qkv(B, T, Hq, Hkv, D, dtype, g):
    """``q [B, T, Hq, D]`` and ``k [B, T, Hkv, D]`` as views of one ``[B, T, (Hq + 2 Hkv) D]`` projection."""
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, T, Hkv, D)
    return q, k


def cos_sin(B, T, D, dtype, g, expanded=False):
    """Real RoPE tables (``cat(freqs, freqs)`` at random positions), or, with ``expanded``, one row of random values
    broadcast over the batch (stride 0)."""
    if expanded:
        c, s = (torch.randn(1, T, D, generator=g).to(dtype).expand(B, T, D) for _ in range(2))
        return c, s
    pos = torch.randint(0, 4096, (B, T), generator=g).float()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def transformers_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb on ``[B, H, T, D]`` tensors (unsqueeze_dim=1), written out."""
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def check(got, want, dtype, inputs, cos, sin):
    """Within two units in the last place of the dtype of the terms each output sums (``|x| * |cos|`` and
    ``|x| * |sin|``, bounded by the row's largest |x| times the largest |cos|, |sin|: the expanded tables are random,
    not bounded by 1). fp32 on a GPU may contract a product and the sum into one fused multiply-add; bf16 / fp16 on the
    GPU differed from the CPU reference in the first GPU run by a term's rounding. Where the sum cancels, that is
    many units of the small result, hence the terms' scale."""
    table = max(float(cos.float().abs().max()), float(sin.float().abs().max()), 1.0) if cos.numel() else 1.0
    for g, w, x in zip(got, want, inputs):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert not g.isnan().any()
        terms = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-3) * table
        assert ((g.float() - w.float()).abs() <= 2 * torch.finfo(dtype).eps * terms).all()


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("D", [2, 64, 96])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (1, 5)])
def test_matches_reference(backend, D, dtype, B, T, gen):
    device = kernel_devices()[0]
    need_backend("apply_rotary", backend, torch.device(device))
    for (Hq, Hkv), expanded in (((3, 1), False), ((2, 2), True)):
        q, k = packed_qkv(B, T, Hq, Hkv, D, dtype, gen)
        cos, sin = cos_sin(B, T, D, dtype, gen, expanded)
        want = apply_rotary(q, k, cos, sin, backend="torch")
        got = apply_rotary(*(t.to(device) for t in (q, k, cos, sin)), backend=backend)
        check([t.cpu() for t in got], want, dtype, (q, k), cos, sin)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_is_transformers_rope(dtype, gen):
    q, k = packed_qkv(2, 3, 4, 2, 64, dtype, gen)
    cos, sin = cos_sin(2, 3, 64, dtype, gen)
    want_q, want_k = transformers_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got_q, got_k = apply_rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q.transpose(1, 2)) and torch.equal(got_k, want_k.transpose(1, 2))
    assert got_q.is_contiguous() and got_k.is_contiguous()


def test_auto_is_the_reference_on_cpu():
    assert _ROTARY.choose("auto", torch.device("cpu")) == "torch"


@pytest.mark.parametrize("backend", backend_params())
def test_torch_compile(backend, gen):
    q, k = packed_qkv(2, 3, 3, 1, 64, torch.bfloat16, gen)
    cos, sin = cos_sin(2, 3, 64, torch.bfloat16, gen)

    def fn(q, k, cos, sin):
        return apply_rotary(q, k, cos * 1.0, sin, backend=backend)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, cos, sin)
    want = fn(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_inputs(gen):
    q, k = packed_qkv(2, 3, 2, 2, 8, torch.bfloat16, gen)
    cos, sin = cos_sin(2, 3, 8, torch.bfloat16, gen)
    swap = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731 - last dim not contiguous
    odd_q, odd_k = packed_qkv(2, 3, 2, 1, 7, torch.bfloat16, gen)
    cases = [
        ("q", dict(q=q.to(torch.int32))),
        (("q", "k"), dict(q=q.float())),  # k no longer matches q
        ("q", dict(q=q[0])),
        ("q", dict(q=odd_q, k=odd_k, cos=cos[..., :7], sin=sin[..., :7])),
        ("q", dict(q=swap(q))),
        ("k", dict(k=k.half())),
        ("k", dict(k=k[:1])),
        ("k", dict(k=k[..., :4])),
        ("k", dict(k=swap(k))),
        ("k", dict(k=k.to("meta"))),
        ("cos", dict(cos=cos.float())),
        ("cos", dict(cos=cos[:, :2])),
        ("cos", dict(cos=swap(cos))),
        ("sin", dict(sin=sin[..., :4])),
        ("sin", dict(sin=sin.to("meta"))),
        ("sin", dict(sin=sin.tolist())),
        ("backend", dict(backend="tpu")),
    ]
    for name, bad in cases:
        args = dict(q=q, k=k, cos=cos, sin=sin, backend="torch")
        args.update(bad)
        assert_rejects(apply_rotary, name, args["q"], args["k"], args["cos"], args["sin"], backend=args["backend"])


def test_exported():
    assert tlt_kernels.apply_rotary is apply_rotary and "apply_rotary" in tlt_kernels.__all__


# ----------------------------------------------------------------------------------------------- property
@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_matches_reference(backend, data):
    """Any B, T (0..3), head counts (1..5, Hq and Hkv independent), even D (2..40), float dtype, q/k packed or
    separate (k a head slice), cos/sin real or expanded: within an ulp of the summed terms, no NaN from finite inputs."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    B, T = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(0, 3), label="T")
    Hq, Hkv = data.draw(st.integers(1, 5), label="Hq"), data.draw(st.integers(1, 5), label="Hkv")
    D = 2 * data.draw(st.integers(1, 20), label="D/2")
    g = gen(data.draw(seeds))
    layout = data.draw(st.sampled_from(["packed", "contiguous", "head_slice"]), label="layout")
    note(f"layout {layout}")
    if layout == "packed":
        q, k = packed_qkv(B, T, Hq, Hkv, D, dtype, g)
    else:
        q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
        k = torch.randn(B, T, Hkv + 1, D, generator=g).to(dtype)
        k = k[:, :, 1:] if layout == "head_slice" else k[:, :, :Hkv].contiguous()
    cos, sin = cos_sin(B, T, D, dtype, g, expanded=data.draw(st.booleans(), label="expanded"))
    want = apply_rotary(q.contiguous(), k.contiguous(), cos.contiguous(), sin.contiguous(), backend="torch")
    got = apply_rotary(q, k, cos, sin, backend=backend)
    check([t.cpu() for t in got], want, dtype, (q, k), cos, sin)


# ----------------------------------------------------------------------------------------------- rotary_to_cache
def packed_qkv_v(B, T, Hq, Hkv, D, dtype, g):
    """``q, k, v`` as views of one packed projection (the model's layout)."""
    qkv = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D: (Hq + Hkv) * D].view(B, T, Hkv, D)
    return q, k, qkv[..., (Hq + Hkv) * D:].view(B, T, Hkv, D)


def cache_case(B, T, Hq, Hkv, D, dtype, g, spare=5):
    """Inputs of rotary_to_cache: ``B * T`` distinct random rows of an ``[B * T + spare, Hkv, D]`` cache holding
    random values (rows not named must keep them)."""
    q, k, v = packed_qkv_v(B, T, Hq, Hkv, D, dtype, g)
    cos, sin = cos_sin(B, T, D, dtype, g)
    rows = B * T + spare
    k_cache, v_cache = (torch.randn(rows, Hkv, D, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(rows, generator=g)[: B * T]
    return [q, k, v, cos, sin, k_cache, v_cache, slots]


def run_to_cache(args, device, backend):
    """``(q_out, k_cache, v_cache)`` on the CPU after rotary_to_cache on ``device`` (caches cloned first)."""
    moved = [t.to(device) for t in args]
    moved[5], moved[6] = moved[5].clone(), moved[6].clone()
    q_out = tlt_kernels.rotary_to_cache(*moved, backend=backend)
    return q_out.cpu(), moved[5].cpu(), moved[6].cpu()


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("D", [2, 64, 96])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv", [(1, 1, 3, 1), (3, 1, 2, 2), (2, 5, 7, 1)])
def test_rotary_to_cache_is_rotary_then_the_cache_write(backend, D, dtype, B, T, Hq, Hkv, gen):
    """q as apply_rotary's, the named cache rows hold apply_rotary's k and the untouched v, every other row keeps its
    bits."""
    device = kernel_devices()[0]
    need_backend("rotary_to_cache", backend, torch.device(device))
    args = cache_case(B, T, Hq, Hkv, D, dtype, gen)
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    want_q, want_k = apply_rotary(q, k, cos, sin, backend="torch")
    got_q, got_k_cache, got_v_cache = run_to_cache(args, device, backend)
    check([got_q, got_k_cache[slots].view(B, T, Hkv, D)], [want_q, want_k], dtype, (q, k), cos, sin)
    assert torch.equal(got_v_cache[slots], v.reshape(-1, Hkv, D))
    others = torch.ones(k_cache.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(got_k_cache[others], k_cache[others]) and torch.equal(got_v_cache[others], v_cache[others])


@pytest.mark.parametrize("backend", agreement_backends())
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv", [(1, 1, 3, 1), (3, 2, 2, 2), (2, 5, 7, 1)])
def test_rotary_to_cache_into_a_slice(backend, dtype, B, T, Hq, Hkv, gen):
    """``q_out`` a strided slice of a poisoned buffer (a drafter's earlier queries before it): the slice holds what a
    new q would, the caches as without it, the buffer's other entries untouched."""
    device = kernel_devices()[0]
    need_backend("rotary_to_cache", backend, torch.device(device))
    D = 64
    args = cache_case(B, T, Hq, Hkv, D, dtype, gen)
    want_q, want_k_cache, want_v_cache = run_to_cache(args, device, backend)
    buffer = torch.full((B, T + 3, Hq + 1, D), float("nan"), dtype=dtype, device=device)
    q_out = buffer[:, 2: T + 2, 1:]
    moved = [t.to(device) for t in args]
    moved[5], moved[6] = moved[5].clone(), moved[6].clone()
    got = tlt_kernels.rotary_to_cache(*moved, q_out=q_out, backend=backend)
    assert got.data_ptr() == q_out.data_ptr() and got.stride() == q_out.stride()
    assert torch.equal(got.cpu(), want_q)
    assert torch.equal(moved[5].cpu(), want_k_cache) and torch.equal(moved[6].cpu(), want_v_cache)
    outside = torch.ones(buffer.shape, dtype=torch.bool)
    outside[:, 2: T + 2, 1:] = False
    assert buffer.cpu()[outside].isnan().all()


def test_rotary_to_cache_bad_inputs(gen):
    args = cache_case(2, 3, 2, 2, 8, torch.bfloat16, gen)
    names = ["q", "k", "v", "cos", "sin", "k_cache", "v_cache", "slots"]
    cases = [
        ("v", dict(v=args[2].half())),
        ("v", dict(v=args[2][:, :, :1])),
        ("k_cache", dict(k_cache=args[5].float())),
        ("k_cache", dict(k_cache=args[5][:, :1])),
        ("k_cache", dict(k_cache=args[5].transpose(0, 1).contiguous().transpose(0, 1))),
        ("v_cache", dict(v_cache=args[6][:-1])),
        ("slots", dict(slots=args[7].int())),
        ("slots", dict(slots=args[7][:-1])),
        ("slots", dict(slots=args[7] + args[5].shape[0])),
        ("slots", dict(slots=args[7] - args[5].shape[0] - 1)),
    ]
    for name, bad in cases:
        call = dict(zip(names, args))
        call.update(bad)
        assert_rejects(tlt_kernels.rotary_to_cache, name, *[call[n] for n in names], backend="torch")
    q = args[0]
    for q_out in (q.float(), q[:, :1].contiguous(), torch.empty(*q.shape[:3], 2 * q.shape[3], dtype=q.dtype)[..., ::2]):
        assert_rejects(tlt_kernels.rotary_to_cache, "q_out", *args, q_out=q_out, backend="torch")


@pytest.mark.parametrize("backend", backend_params())
def test_rotary_to_cache_under_torch_compile(backend, gen):
    """The custom op's fake and mutation annotations: a compiled call writes the caches like an eager one."""
    args = cache_case(2, 3, 3, 1, 64, torch.bfloat16, gen)

    def fn(q, k, v, cos, sin, k_cache, v_cache, slots):
        return tlt_kernels.rotary_to_cache(q, k, v, cos * 1.0, sin, k_cache, v_cache, slots, backend=backend,
                                           validate=False)

    torch._dynamo.reset()
    compiled = [t.clone() for t in args]
    eager = [t.clone() for t in args]
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*compiled)
    want = fn(*eager)
    assert torch.equal(got, want) and torch.equal(compiled[5], eager[5]) and torch.equal(compiled[6], eager[6])


@pytest.mark.parametrize("backend", backend_params())
def test_rotary_to_cache_into_under_torch_compile(backend, gen):
    """With ``q_out``: the compiled call writes the slice and the caches as an eager one does."""
    args = cache_case(2, 3, 3, 1, 64, torch.bfloat16, gen)

    def fn(q, k, v, cos, sin, k_cache, v_cache, slots, buffer):
        tlt_kernels.rotary_to_cache(q, k, v, cos * 1.0, sin, k_cache, v_cache, slots, q_out=buffer[:, 1:],
                                    backend=backend, validate=False)
        return buffer * 2

    torch._dynamo.reset()
    buffer = torch.zeros(2, 4, 3, 64, dtype=torch.bfloat16)
    compiled = [t.clone() for t in args] + [buffer.clone()]
    eager = [t.clone() for t in args] + [buffer.clone()]
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(*compiled)
    want = fn(*eager)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(compiled[5:], eager[5:]))
    assert compiled[8][:, 1:].abs().sum() > 0  # the slice was written


@budget(10)
@given(st.data())
@pytest.mark.parametrize("backend", backend_params())
def test_property_rotary_to_cache(backend, data):
    """Any B, T (0..3), head counts, even D, dtype: the named rows as rotary + copy, the others untouched."""
    dtype = data.draw(st.sampled_from(FLOAT_DTYPES), label="dtype")
    B, T = data.draw(st.integers(0, 3), label="B"), data.draw(st.integers(0, 3), label="T")
    Hq, Hkv = data.draw(st.integers(1, 5), label="Hq"), data.draw(st.integers(1, 5), label="Hkv")
    D = 2 * data.draw(st.integers(1, 20), label="D/2")
    g = gen(data.draw(seeds))
    args = cache_case(B, T, Hq, Hkv, D, dtype, g, spare=data.draw(st.integers(0, 4), label="spare"))
    q, k, v, cos, sin, k_cache, v_cache, slots = args
    want = run_to_cache(args, "cpu", "torch")
    got = run_to_cache(args, kernel_devices()[0], backend)
    rows = lambda cache: cache[slots].view(B, T, Hkv, D)  # noqa: E731 - the written rows in k's layout
    check([got[0], rows(got[1])], [want[0], rows(want[1])], dtype, (q, k), cos, sin)
    others = torch.ones(k_cache.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(got[1][others], k_cache[others]) and torch.equal(got[2], want[2])


@pytest.mark.skipif(HAS_CUDA, reason="a GPU compiles the kernels in its own tests")
def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: compile both kernels for sm_90, each dtype (the rotated q's
    head stride an argument of the cache kernel: a slice of a larger buffer)."""
    compile_for_sm90(r"""
from tlt_kernels._triton import rotary as m

for dt in ("*bf16", "*fp16", "*fp32"):
    sizes = dict(HQ_POW2=16, HKV_POW2=4, HALF_POW2=32, HAND_ROUND=False)
    compile_sm90(m._rotary_kernel, [dt] * 6 + ["i32"] * 4 + ["i64"] * 10, sizes, 4)
    compile_sm90(m._rotary_cache_kernel, [dt] * 5 + ["*i64"] + [dt] * 3 + ["i32"] * 4 + ["i64"] * 17, sizes, 4)
""")
