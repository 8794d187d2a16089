"""The one-launch rollout step (:mod:`tlt_kernels._triton.rollout_step`) against the torch path it replaces
(``RolloutState.emit``, ``commit``, ``stage_counts``): same state, same staging vector, same emission.

Without a GPU the kernel runs in Triton's CPU interpreter (int64 / int32 / bool only: exact there)."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import compile_for_sm90, kernel_devices
from tlt_kernels.engine import state as state_mod
from tlt_kernels.engine.state import RolloutState

DEV = kernel_devices()[0]
STATE = ("output_tokens", "generated", "max_new_tokens", "done", "context_lens", "offsets", "root_tokens")


def _case(seed: int, B=None, T=None, eos="random", depth=None, error_dtype=torch.int32):
    """A random rollout state and one step's inputs: some rows at or near their budget, some finished before
    (``done``), some failed, EOS absent or a token that appears, any depth 0..4."""
    g = torch.Generator().manual_seed(seed)

    def ri(lo, hi, shape=()):  # integers in [lo, hi]
        return torch.randint(lo, hi + 1, shape, generator=g)

    B = int(ri(1, 40)) if B is None else B
    T = int(ri(1, 9)) if T is None else T
    b = int(ri(1, B))
    vocab = int(ri(2, 8))  # few tokens: EOS shows up often
    max_new = ri(1, 12, (B,))
    near = ri(0, 3, (B,))  # 0..3 tokens left, else anywhere below the budget
    generated = torch.where(ri(0, 1, (B,)).bool(), (max_new - near).clamp(min=0), ri(0, 12, (B,)) % (max_new + 1))
    done = (generated >= max_new) | (ri(0, 4, (B,)) == 0)
    W = int(max_new.max()) + T + 1
    output_tokens = torch.full((B, W), -1, dtype=torch.int64)
    for r in range(B):
        output_tokens[r, : int(generated[r])] = ri(0, vocab - 1, (int(generated[r]),))
    rows = torch.randperm(B, generator=g)[:b]
    num_accepted = ri(0, T - 1, (b,))
    emitted = torch.where(torch.arange(T) <= num_accepted[:, None], ri(0, vocab - 1, (b, T)), -1)
    error = (ri(0, 4, (b,)) == 0).to(error_dtype)
    eos_token_id = None if eos is None or (eos == "random" and int(ri(0, 2)) == 0) else int(ri(0, vocab - 1))
    state = RolloutState(
        block_table=torch.zeros(B, 1, dtype=torch.int32), context_lens=ri(1, 100, (B,)).to(torch.int32),
        offsets=ri(0, 50, (B,)), root_tokens=ri(0, vocab - 1, (B,)), output_tokens=output_tokens,
        generated=generated, max_new_tokens=max_new, active_rows=rows.tolist(), context_lens_host=[0] * B,
        start_time=0.0, prefill_s=0.0, start_batch_size=B, finish_s=[0.0] * B, errors=[], done=done)
    inputs = dict(rows=rows, emitted=emitted, num_accepted=num_accepted, error=error,
                  new_context_lens=ri(1, 120, (b,)).to(torch.int32), eos_token_id=eos_token_id,
                  depth=int(ri(0, 4)) if depth is None else depth, active_rows=rows.tolist())
    return state, inputs


def _to(state: RolloutState, inputs: dict, device) -> tuple:
    state = copy.deepcopy(state)
    for name in STATE:
        setattr(state, name, getattr(state, name).to(device))
    return state, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _check_agreement(seed: int, step_blocks=None, **kwargs) -> None:
    state, inputs = _case(seed, **kwargs)
    ref_state, ref_inputs = _to(state, inputs, "cpu")
    ker_state, ker_inputs = _to(state, inputs, DEV)
    ker_state.step_blocks = step_blocks
    ref, ref_staged = ref_state.finish_step(**ref_inputs, use_kernel=False)
    out, staged = ker_state.finish_step(**ker_inputs, use_kernel=True)
    if staged.ready is not None:
        staged.ready.synchronize()
    for name in STATE:
        assert torch.equal(getattr(ker_state, name).cpu(), getattr(ref_state, name)), (seed, name)
    assert torch.equal(staged.values.cpu(), ref_staged.values), (seed, staged.values, ref_staged.values)
    assert (staged.rows, staged.depth) == (ref_staged.rows, ref_staged.depth)
    for name in ("counts", "finished", "failed", "was_done", "keep"):
        a, r = getattr(out, name).cpu(), getattr(ref, name)
        assert a.dtype == r.dtype and torch.equal(a, r), (seed, name, a, r)
    assert (ker_state.output_tokens[:, -1] == -1).all()


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(40))
def test_kernel_matches_the_torch_path(seed):
    _check_agreement(seed)


@pytest.mark.triton
@pytest.mark.parametrize("eos", [None, "random"])
@pytest.mark.parametrize("B,T,depth", [(1, 1, 0), (1, 9, 4), (40, 1, 2), (37, 8, 3), (64, 16, 5)])
def test_kernel_edges(B, T, depth, eos):
    """One row, one column, wide trees and every depth; a bool error flag (the torch path's own dtype)."""
    for seed in range(3):
        _check_agreement(1000 + seed, B=B, T=T, eos=eos, depth=depth, error_dtype=torch.bool)


@pytest.mark.triton
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 12), T=st.integers(1, 6), depth=st.integers(0, 4),
       eos=st.sampled_from([None, "random"]))
def test_kernel_matches_the_torch_path_property(seed, B, T, depth, eos):
    _check_agreement(seed, B=B, T=T, eos=eos, depth=depth)


@pytest.mark.triton
@pytest.mark.parametrize("seed", range(12))
def test_kernel_with_the_engines_blocks(seed):
    """An engine's fixed (block_rows, block_tokens), wider than the step needs: the same results."""
    _check_agreement(2000 + seed, step_blocks=(64, 16))


@pytest.mark.parametrize("seed", range(20))
def test_lagging_rows_are_staged(seed):
    """The staged lagging rows: the live rows (not failed, not finished before) with the most tokens left before the
    step, how many of them reached each depth, and how far the step moved the batch's end (the kernel stages the same
    vector: the tests above)."""
    state, inputs = _case(3000 + seed, depth=3)
    rows, num_accepted = inputs["rows"], inputs["num_accepted"]
    left = (state.max_new_tokens - state.generated)[rows]
    live = ~(state.done[rows] | inputs["error"].bool())
    emission, staged = state.finish_step(**inputs, use_kernel=False)
    counts = state.read_counts(staged)
    if not live.any():
        assert counts.lagging_rows == 0 and counts.lagging_accepted_per_depth == [0, 0, 0] and counts.progress == 0
        return
    lagging = live & (left == left[live].max())
    assert counts.lagging_rows == int(lagging.sum()) >= 1
    assert counts.lagging_accepted_per_depth == [int((lagging & (num_accepted >= d)).sum()) for d in (1, 2, 3)]
    assert counts.accepted_per_depth == [int((live & (num_accepted >= d)).sum()) for d in (1, 2, 3)]
    # The batch's end moved from the most tokens left to the most a live, unfinished row has left after the step.
    after = [int(left[r] - emission.counts[r]) for r in range(len(rows)) if live[r] and not emission.finished[r]]
    assert counts.progress == int(left[live].max()) - max(after, default=0)


def test_fixed_blocks_make_one_variant():
    """With an engine's bounds every step's launch has the same compile-time sizes, whatever its row count, tree
    width and depth (a new variant mid-rollout is a JIT compile); without them the sizes fit the step."""
    from tlt_kernels._triton.rollout_step import block_sizes

    seen = {block_sizes(b, T, 40, depth, 64, 16) for b in range(1, 41) for T in range(1, 10) for depth in range(5)}
    assert seen == {(64, 16, 64, 16)}
    assert block_sizes(3, 5, 40, 2) == (4, 8, 64, 2)
    assert block_sizes(1, 1, 1, 0) == (1, 1, 1, 1)


@pytest.mark.parametrize("blocks,name", [((32, 16), "block_rows"), ((48, 16), "block_rows"),
                                         ((64, 4), "block_tokens"), ((64, 12), "block_tokens")])
def test_bad_blocks_are_named(blocks, name):
    """Bounds below the step's sizes, or not powers of two, raise a ValueError naming the argument."""
    from tlt_kernels._triton.rollout_step import block_sizes

    with pytest.raises(ValueError, match=name):
        block_sizes(5, 9, 40, 4, *blocks)


def test_the_torch_path_is_emit_commit_stage():
    """finish_step's torch path is exactly emit, commit (keep = was_done | failed), stage_counts, in that order."""
    state, inputs = _case(7, B=20, T=5, depth=3)
    a, _ = _to(state, inputs, "cpu")
    b, _ = _to(state, inputs, "cpu")
    emission, staged = a.finish_step(**inputs, use_kernel=False)
    i = inputs
    em = b.emit(i["rows"], i["emitted"], i["num_accepted"], i["error"].bool(), i["eos_token_id"])
    b.commit(i["rows"], i["new_context_lens"], i["emitted"], i["num_accepted"], em.was_done | em.failed)
    want = b.stage_counts(em, i["num_accepted"], i["new_context_lens"], i["active_rows"], i["depth"])
    assert torch.equal(staged.values, want.values)
    assert torch.equal(emission.keep, em.was_done | em.failed)
    for name in STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_use_kernel_follows_the_rollouts_step_kernel(monkeypatch):
    """use_kernel=None: the kernel when the rollout's step_kernel is True, or None (the default) on CUDA tensors;
    never on a device the kernel cannot run on (SpeculativeEngine(step_kernel=))."""
    calls = []

    class Launched(Exception):
        pass

    def launch(*args):
        calls.append(args)
        raise Launched

    monkeypatch.setattr(state_mod, "rollout_step", launch)
    state, inputs = _case(3)
    state.step_kernel = False
    state.finish_step(**inputs)  # step_kernel off: the torch path
    assert not calls
    state.step_kernel = None  # the default: the kernel on CUDA tensors only
    if inputs["emitted"].is_cuda:
        with pytest.raises(Launched):
            state.finish_step(**inputs)
        calls.clear()
    else:
        state.finish_step(**inputs)
        assert not calls
    state.step_kernel = True
    monkeypatch.setattr(state_mod, "kernel_can_run_on", lambda device: True)
    with pytest.raises(Launched):
        state.finish_step(**inputs)
    assert len(calls) == 1
    monkeypatch.setattr(state_mod, "kernel_can_run_on", lambda device: False)  # e.g. the CPU without the interpreter
    state.finish_step(**inputs)
    assert len(calls) == 1


def test_the_op_names_a_device_it_cannot_run_on(monkeypatch):
    """On the CPU without Triton's interpreter the op raises a ValueError naming ``emitted`` (no launch, whose
    own error would only say a pointer cannot be accessed)."""
    from tlt_kernels.ops import rollout_step as op

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    state, inputs = _case(4)
    if inputs["emitted"].is_cuda:
        pytest.skip("the case's tensors are on a GPU")
    with pytest.raises(ValueError, match="emitted is on cpu"):
        op.rollout_step(inputs["rows"], inputs["emitted"], inputs["num_accepted"], inputs["error"],
                        inputs["new_context_lens"], inputs["eos_token_id"], inputs["depth"], state.output_tokens,
                        state.generated, state.max_new_tokens, state.done, state.context_lens, state.offsets,
                        state.root_tokens)


_COMPILE_SM90 = r"""
from tlt_kernels._triton import rollout_step as m

for has_eos, block_b, block_t, bool_error in ((True, 256, 64, False), (False, 1, 1, True), (True, 1024, 16, False)):
    consts = dict(HAS_EOS=has_eos, BLOCK_B=block_b, BLOCK_T=block_t, BLOCK_ALL=4096, BLOCK_D=4)
    types = ["*i64", "*i64", "*i32", "*i1" if bool_error else "*i32", "*i32",
             "*i64", "*i64", "*i64", "*i1", "*i32", "*i64", "*i64",
             "*i64", "*i64", "*i1", "*i1", "*i1", "*i1"] + ["i32"] * 4 + ["i64"] + ["i32"] * 4
    compile_sm90(m._rollout_step_kernel, types, consts, m._num_warps(block_b * block_t))
"""


@pytest.mark.slow
def test_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the kernel for sm_90 (needs ptxas only)."""
    compile_for_sm90(_COMPILE_SM90)


def test_the_ops_row_bound_is_the_kernels():
    """ops.rollout_step repeats the kernel's MAX_ROWS (the op module must not import Triton at package import):
    the two must agree, or finish_step would send the kernel more rows than its one program holds."""
    from tlt_kernels._triton import rollout_step as kernel
    from tlt_kernels.ops import rollout_step as op

    assert op.MAX_ROWS == kernel.MAX_ROWS
