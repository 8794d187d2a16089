"""Host reads per decoding step: the engine's step reads the device at most once (docs/RUNTIME.md, "Host reads per
step").

Every device-to-host read stalls the CPU until the GPU drains, so the next step's launches cannot overlap this
step's kernels. On the CPU nothing syncs, so the test counts the calls that *would* read a CUDA tensor: ``item``,
``tolist``, ``cpu``, ``numpy``, ``bool``/``int``/``float`` of a tensor, ``nonzero`` (its size is data dependent) and
indexing with a boolean mask. Only calls made while ``SpeculativeEngine._step`` runs are counted (prefill and the
result's assembly read the device on purpose). The engine keeps its host bookkeeping in Python lists, so every
counted call is a read a CUDA rollout would pay. Not counted, because a CUDA rollout does not run them: the ops'
``torch`` reference backends (``tlt_kernels/reference/``; on CUDA, ``backend="auto"`` runs the Triton/CUDA
kernels) and the closures a fake graph backend replays (a captured CUDA graph replays no Python).
"""
import collections
import contextlib
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode


from tlt_kernels.drafter import EagleDrafter, RolloutBuffer
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.state import RolloutState
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import GraphPool, Strategy, StrategySelector
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]
PROMPTS = [[(7 * b + 3 * i) % 200 + 10 for i in range(6 + 2 * b)] for b in range(len(MAX_NEW))]

# The contract: reads per step. The one left is RolloutState.read_counts' single ``tolist`` of the step's
# outcome (finished / failed flags, new context lengths, emitted and tried totals, tokens so far, acceptance per
# depth), which the host needs to retire requests, feed the selector and size the next step's attention plan.
# Once per rollout, before the first step's, RolloutState.settle_start reads the start's outcome (which requests
# finished at their first token): its copy was queued before that step's, so it waits for nothing more; it is
# counted apart. The rollout's start (SpeculativeEngine._start: prefill, first tokens, drafter start) reads nothing.
MAX_READS_PER_STEP = 1


class ReadCounter:
    """Counts tensor reads (by the line of the caller in tlt_kernels) while ``active``."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")

    def __init__(self):
        self.active = False
        self.inside = False
        self.reads = collections.Counter()

    def _where(self):
        """The caller's ``file:line code`` in tlt_kernels; None inside a reference op (not run on CUDA)."""
        stack = traceback.extract_stack()[:-3]
        if any("tlt_kernels/reference/" in frame.filename for frame in stack):
            return None
        for frame in reversed(stack):
            if "tlt_kernels" in frame.filename and "/tests/" not in frame.filename:
                return f"{frame.filename.rsplit('tlt_kernels/', 1)[-1]}:{frame.lineno} {frame.line}"
        return "?"

    def _note(self, what: str) -> None:
        if self.active:
            where = self._where()
            if where is not None:
                self.reads[f"{what} @ {where}"] += 1

    @staticmethod
    def _is_mask(index) -> bool:
        return any(p.dtype == torch.bool for p in _index_tensors(index))

    @contextlib.contextmanager
    def patched(self, monkeypatch):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, _original=original, _name=name, **kwargs):
                # The indexing mode below re-dispatches the call through this wrapper: count the outer call only.
                if t.numel() >= 1 and not self.inside:
                    self._note(_name)
                inside, self.inside = self.inside, True
                try:
                    return _original(t, *args, **kwargs)
                finally:
                    self.inside = inside

            monkeypatch.setattr(torch.Tensor, name, wrapper)
        nonzero = torch.nonzero

        def nonzero_fn(t, *args, **kwargs):
            self._note("torch.nonzero")
            return nonzero(t, *args, **kwargs)

        monkeypatch.setattr(torch, "nonzero", nonzero_fn)
        # Indexing is watched through a torch-function mode, not by patching Tensor.__getitem__: setting that
        # attribute on the class fills its C sequence slot for good, and torch.tensor([0-d tensors]) then fails
        # in later tests ("len() of a 0-d tensor").
        with _MaskIndexing(self):
            yield self


class _MaskIndexing(TorchFunctionMode):
    """Notes indexing with a boolean mask (a data-dependent size: a device read) to ``counter``, and a Python
    scalar stored through a tensor index (``t[rows] = 0``: on CUDA the scalar becomes a host tensor copied to the
    device synchronously, which waits for the stream like a read)."""

    def __init__(self, counter: "ReadCounter"):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) > 1 and self.counter._is_mask(args[1]):
            self.counter._note("mask index")
        if func is torch.Tensor.__setitem__ and len(args) > 2 and _index_tensors(args[1]) \
                and not isinstance(args[2], torch.Tensor):
            self.counter._note("scalar stored through a tensor index")
        return func(*args, **(kwargs or {}))


def _index_tensors(index) -> list:
    """The tensors among an indexing expression's parts."""
    parts = index if isinstance(index, tuple) else (index,)
    return [p for p in parts if isinstance(p, torch.Tensor)]


def _engine(target, kind, fuse, rollout_buffer=None):
    pool = None
    if fuse is not None:
        pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1)
    torch.manual_seed(0)
    if kind == "none":
        drafter, sel = None, Strategy.off()
    elif kind == "ngram":
        drafter, sel = "ngram", StrategySelector([Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)], seed=0)
    else:
        drafter, sel = EagleDrafter.for_target(target), StrategySelector([Strategy(2, 1, 3), Strategy(3, 2, 6)], seed=0)
    eng = SpeculativeEngine(target, drafter, sel, pool, max_batch_size=8, max_seq_len=64, fuse_step=bool(fuse),
                            rollout_buffer=rollout_buffer)
    if pool is not None:
        eng.capture_graphs([2, 8])
        assert eng.graph_error is None, eng.graph_error
    return eng


def count_step_reads(eng, monkeypatch, **generate_kwargs):
    """``(output, reads per step [list of Counters])`` of one rollout, counting only inside ``_step``; the start's
    outcome (RolloutState.settle_start) must be read exactly once, and is not counted."""
    counter, per_step, settled = ReadCounter(), [], []
    step = eng._step
    settle = RolloutState.settle_start

    def counted_settle(rollout):
        if rollout.start_outcome is not None:
            settled.append(rollout)
        active, counter.active = counter.active, False
        try:
            settle(rollout)
        finally:
            counter.active = active

    monkeypatch.setattr(RolloutState, "settle_start", counted_settle)

    def counted_step(rollout):
        counter.reads = collections.Counter()
        counter.active = True
        try:
            step(rollout)
        finally:
            counter.active = False
        per_step.append(counter.reads)

    monkeypatch.setattr(eng, "_step", counted_step)
    if eng.graph_pool is not None:  # a replayed CUDA graph runs no Python: the fake backend's closures do not count
        run = eng.graph_pool.run

        def replay(*args, **kwargs):
            active, counter.active = counter.active, False
            try:
                return run(*args, **kwargs)
            finally:
                counter.active = active

        monkeypatch.setattr(eng.graph_pool, "run", replay)
    with counter.patched(monkeypatch):
        out = eng.generate(PROMPTS, MAX_NEW, **generate_kwargs)
    assert len(settled) == 1
    return out, per_step


def count_start_reads(eng, monkeypatch, **generate_kwargs) -> collections.Counter:
    """The reads of one rollout's ``_start`` (prefill, first tokens, the drafter's start, the rollout's state)."""
    counter, start = ReadCounter(), eng._start

    def counted_start(*args, **kwargs):
        counter.active = True
        try:
            return start(*args, **kwargs)
        finally:
            counter.active = False

    monkeypatch.setattr(eng, "_start", counted_start)
    with counter.patched(monkeypatch):
        eng.generate(PROMPTS, MAX_NEW, **generate_kwargs)
    return counter.reads


# (drafter, runner): None = eager, False = separate graphs (fake backend), True = fused step graphs.
CASES = [("none", None), ("ngram", None), ("eagle", None), ("none", False), ("eagle", False), ("none", True),
         ("eagle", True), ("ngram", True)]


@pytest.mark.parametrize("kind,fuse", CASES, ids=lambda v: str(v))
def test_one_host_read_per_step(target, monkeypatch, kind, fuse):
    eng = _engine(target, kind, fuse)
    out, per_step = count_step_reads(eng, monkeypatch)
    # One loop turn per step, and one for an overlapped step launched after the last request finished (no step).
    assert len(out.steps) > 3 and len(per_step) in (len(out.steps), len(out.steps) + 1)
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i} ({kind}, fuse={fuse}): {dict(reads)}"
    # Counting changed nothing: greedy output is still plain decoding's.
    ref = reference_generate(target, PROMPTS, max(MAX_NEW))
    for b, n in enumerate(MAX_NEW):
        assert out.tokens[b] == ref.tokens[b, :n].tolist(), f"request {b}"


@pytest.mark.parametrize("kind,fuse", CASES, ids=lambda v: str(v))
def test_the_rollout_start_reads_nothing(target, monkeypatch, kind, fuse):
    """After generate's checks the host never waits for the GPU until the first step's outcome: it prepares the first
    step while the prefill runs (a read there idled the GPU while the host prepared it: the first step's gap, and
    the n-gram drafter's start read twice more)."""
    reads = count_start_reads(_engine(target, kind, fuse), monkeypatch)
    assert not reads, f"{kind}, fuse={fuse}: {dict(reads)}"


def test_the_rollout_start_reads_nothing_with_sampling_eos_and_log_probs(target, monkeypatch):
    eng = SpeculativeEngine(target, "ngram", Strategy(2, 1, 3), max_batch_size=8, max_seq_len=64, logprobs=True)
    reads = count_start_reads(eng, monkeypatch, temperature=0.8, top_p=0.9, seed=list(range(7)),
                              eos_token_id=out_token(target))
    assert not reads, dict(reads)


@pytest.mark.parametrize("fuse", [None, True], ids=["eager", "fused"])
def test_one_host_read_per_step_with_a_rollout_buffer(target, monkeypatch, fuse):
    """Capturing features for the spot trainer adds no read: finished requests go to the buffer with their host
    context lengths (a pinned or GPU buffer then copies without waiting; docs/RUNTIME.md)."""
    buffer = RolloutBuffer(capacity_tokens=1 << 14, storage_dtype=torch.float32)
    eng = _engine(target, "eagle", fuse, rollout_buffer=buffer)
    out, per_step = count_step_reads(eng, monkeypatch)
    assert buffer.num_tokens > 0 and len(buffer) == sum(n > 1 for n in MAX_NEW)  # the stepped requests
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i}: {dict(reads)}"
    assert out.errors == []


def test_one_host_read_per_step_with_sampling_and_eos(target, monkeypatch):
    """Sampling (temperature, top-p) and an EOS id add no read."""
    eng = _engine(target, "ngram", None)
    out, per_step = count_step_reads(eng, monkeypatch, temperature=0.8, top_p=0.9, seed=list(range(7)),
                                     eos_token_id=out_token(target))
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i}: {dict(reads)}"


@pytest.mark.parametrize("fuse", [None, True], ids=["eager", "fused"])
def test_one_host_read_per_step_with_a_forecast(target, monkeypatch, fuse):
    """A selector with the requests' acceptance forecast adds no read: each row's accepted drafts come from the
    step's one transfer (its new context lengths, already staged)."""
    from tlt_kernels.runtime import AcceptanceForecast

    eng = _engine(target, "ngram", fuse)
    eng.selector = StrategySelector([Strategy(2, 1, 3), Strategy(4, 1, 5)], seed=0, forecast=AcceptanceForecast(),
                                    available=eng.selector.available)
    out, per_step = count_step_reads(eng, monkeypatch)
    assert any(s.strategy != "off" for s in out.steps)
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i}: {dict(reads)}"


@pytest.mark.parametrize("fuse", [None, True], ids=["eager", "fused"])
def test_one_host_read_per_step_with_the_counterfactual_policy(target, monkeypatch, fuse):
    """Every drafting arm's counterfactual counts add no read: they are staged at the end of the step's one
    transfer (tlt_kernels/engine/counterfactual.py)."""
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if fuse else None
    selector = StrategySelector([Strategy(2, 1, 3), Strategy(4, 1, 5), Strategy(3, 2, 7)], policy="counterfactual")
    eng = SpeculativeEngine(target, "ngram", selector, pool, max_batch_size=8, max_seq_len=64, fuse_step=bool(fuse))
    if pool is not None:
        eng.capture_graphs([2, 8])
    out, per_step = count_step_reads(eng, monkeypatch)
    assert selector.policy.counterfactuals > 0
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i}: {dict(reads)}"


def out_token(target) -> int:
    """A token the tiny target emits often (so EOS does stop some requests)."""
    ref = reference_generate(target, PROMPTS, 8)
    return int(torch.mode(ref.tokens.flatten()).values)


def test_the_counter_sees_each_kind_of_read(monkeypatch):
    """The counter itself: each watched read is noted once (from tlt_kernels code only), boolean-mask indexing
    included, and integer indexing is not a read; torch.tensor of 0-d tensors still works afterwards."""
    counter = ReadCounter()
    counter._where = lambda: "here"  # these reads come from the test, not from tlt_kernels
    x = torch.arange(6)
    with counter.patched(monkeypatch):
        counter.active = True
        x.tolist(), x.sum().item(), bool(x[0]), x[x > 2], x[1], torch.nonzero(x)
        y = x.clone()
        y[torch.tensor([0, 1])] = 0  # noted: a synchronous copy on CUDA
        y[torch.tensor([2])] = torch.zeros(1, dtype=y.dtype)  # not noted: a device tensor, or a plain slice
        y[3:] = 1
        counter.active = False
    assert counter.reads == collections.Counter({"tolist @ here": 1, "item @ here": 1, "__bool__ @ here": 1,
                                                 "mask index @ here": 1, "torch.nonzero @ here": 1,
                                                 "scalar stored through a tensor index @ here": 1})
    monkeypatch.undo()
    assert torch.tensor([x[0], x[1], 0]).tolist() == [0, 1, 0]


@pytest.mark.triton
@pytest.mark.parametrize("kind,fuse,sampled", [("eagle", None, False), ("ngram", None, True), ("none", True, False)],
                         ids=str)
def test_the_rollout_step_kernel_adds_no_read(target, monkeypatch, kind, fuse, sampled):
    """The one-launch rollout step (RolloutState.finish_step's kernel path, SpeculativeEngine(step_kernel=True); here
    in the interpreter) reads the device no more than the torch path, and the rollout is the torch path's. The kernel's
    interpreted run is not counted (on a GPU a launch reads nothing); its Python wrapper is."""
    from tlt_kernels._triton import rollout_step as kernel_module
    from tlt_kernels.ops.rollout_step import can_run_on

    if not can_run_on(next(target.parameters()).device):  # this module's target is on the CPU
        pytest.skip("the tiny target is on the CPU: the kernel runs there only under TRITON_INTERPRET=1")
    kwargs = dict(temperature=0.8, top_p=0.9, seed=list(range(7)), eos_token_id=out_token(target)) if sampled else {}
    want = _engine(target, kind, fuse).generate(PROMPTS, MAX_NEW, **kwargs)
    counter_box, launches, real = [], [], kernel_module._rollout_step_kernel

    class Uncounted:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(grid)
                active, counter_box[0].active = counter_box[0].active, False
                try:
                    return real[grid](*args, **kw)
                finally:
                    counter_box[0].active = active
            return launch

    monkeypatch.setattr(kernel_module, "_rollout_step_kernel", Uncounted())
    real_patched = ReadCounter.patched

    def patched(self, mp):  # keep a handle on the counter count_step_reads makes
        counter_box[:] = [self]
        return real_patched(self, mp)

    monkeypatch.setattr(ReadCounter, "patched", patched)
    eng = _engine(target, kind, fuse)
    eng.step_kernel = True  # the kernel path (Triton's interpreter on the CPU)
    out, per_step = count_step_reads(eng, monkeypatch, **kwargs)
    assert len(launches) >= len(out.steps) > 3
    for i, reads in enumerate(per_step):
        assert sum(reads.values()) <= MAX_READS_PER_STEP, f"step {i} ({kind}, fuse={fuse}): {dict(reads)}"
    assert out.tokens == want.tokens and torch.equal(out.lengths, want.lengths) and out.errors == want.errors
