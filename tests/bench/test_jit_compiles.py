"""bench.jit_compiles.CompileCounter: counts the compiles Triton reports inside its block, chains to a hook that was
installed before, and puts it back on exit (Triton calls the hook itself on a GPU; here the test calls it)."""
from types import SimpleNamespace

import pytest

from bench.jit_compiles import CompileCounter

knobs = pytest.importorskip("triton").knobs


def _compile(name):  # what Triton does after compiling a kernel variant
    knobs.runtime.jit_post_compile_hook(key=None, repr=name, fn=SimpleNamespace(name=name), compile={},
                                        is_manual_warmup=False, already_compiled=False)


def test_counts_compiles_by_kernel_and_restores_the_hook():
    seen = []
    outer = lambda **kwargs: seen.append(kwargs["fn"].name)  # noqa: E731
    knobs.runtime.jit_post_compile_hook = outer
    try:
        with CompileCounter() as jit:
            _compile("_step")
            _compile("_attn")
            _compile("_step")
        assert jit.count == 3 and jit.kernels == {"_step": 2, "_attn": 1}
        assert jit.describe("plain, B=4") == "plain, B=4: 3 Triton compiles: _step 2, _attn 1"
        assert seen == ["_step", "_attn", "_step"]  # the earlier hook still sees every compile
        assert knobs.runtime.jit_post_compile_hook is outer
    finally:
        knobs.runtime.jit_post_compile_hook = None


def test_nothing_counted_outside_the_block():
    with CompileCounter() as jit:
        pass
    assert knobs.runtime.jit_post_compile_hook is None
    assert jit.count == 0 and not jit.kernels


def test_variants_name_the_scalar_constexprs_of_each_compile():
    """Each compile's number and bool constants, by argument name (Triton keys them by argument index tuples),
    go into the note: which specialization was new."""
    kernel = SimpleNamespace(name="_attn", jit_function=SimpleNamespace(arg_names=["q", "k", "BLOCK_T", "CAUSAL"]))
    with CompileCounter() as jit:
        knobs.runtime.jit_post_compile_hook(key=None, repr="_attn", fn=kernel,
                                            compile={"constants": {(2,): 16, (3,): True, (0,): "skip"}},
                                            is_manual_warmup=False, already_compiled=False)
        _compile("_step")
    assert jit.variants == [("_attn", {"BLOCK_T": 16, "CAUSAL": True}), ("_step", {})]
    assert jit.describe("spec") == "spec: 2 Triton compiles: _attn 1, _step 1 [_attn(BLOCK_T=16, CAUSAL=True)]"
