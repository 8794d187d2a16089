"""Feature capture for the rollout buffer: what the spot trainer learns from must be the rollout's own sequences.

``FeatureCapture.record`` against a per-position loop (skipped rows, padded paths, the sink column), and a whole
rollout: every buffered entry holds its request's committed tokens and the target's features of them (a dense
teacher-forced forward over the same tokens), for plain, n-gram and EAGLE steps, eager and replayed from step graphs.
"""
import pytest
import torch

from conftest import ragged_prompts

from tlt_kernels.drafter import EagleDrafter, RolloutBuffer
from tlt_kernels.engine import SpeculativeEngine
from tlt_kernels.engine.capture import FeatureCapture
from tlt_kernels.models import reference_generate
from tlt_kernels.runtime import GraphPool, Strategy
from tlt_kernels.runtime.graph_pool import FakeGraphBackend

MAX_NEW = [5, 23, 9, 30, 3, 17, 1]


def _capture(B=6, L=5, H=7, columns=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, 100, (B, L), generator=gen)
    return FeatureCapture(prompts, torch.randn(B, L, H, generator=gen), columns), gen


@pytest.mark.parametrize("width", [1, 4, 9])
def test_record_writes_the_accepted_path_and_nothing_else(width):
    cap, gen = _capture()
    columns, H = cap.tokens.shape[1], cap.features.shape[2]
    rows = torch.tensor([4, 0, 2, 5])  # not in order; rows 1 and 3 are not in the step
    context_lens = torch.tensor([5, 9, 17, 5], dtype=torch.int32)
    num_accepted = torch.tensor([width - 1, 0, -1, min(2, width - 1)])  # -1: a row that keeps its state
    path_hidden = torch.randn(len(rows), width, H, generator=gen)
    path_tokens = torch.randint(100, 200, (len(rows), width), generator=gen)
    want_features, want_tokens = cap.features.clone(), cap.tokens.clone()
    for i, row in enumerate(rows.tolist()):
        for j in range(int(num_accepted[i]) + 1):
            want_features[row, int(context_lens[i]) + j] = path_hidden[i, j]
            want_tokens[row, int(context_lens[i]) + j] = path_tokens[i, j]
    cap.record(rows, context_lens, num_accepted, path_hidden, path_tokens)
    sink = columns - 1  # garbage by design: compare every other column exactly
    assert torch.equal(cap.tokens[:, :sink], want_tokens[:, :sink])
    assert torch.equal(cap.features[:, :sink], want_features[:, :sink])


def test_add_to_buffer_takes_the_host_lengths():
    cap, _ = _capture()
    buffer = RolloutBuffer(capacity_tokens=1 << 10, storage_dtype=torch.float32)
    cap.add_to_buffer(buffer, [3, 1], [5, 2], step=7)
    cap.add_to_buffer(buffer, [], [], step=8)  # nothing finished: nothing added
    assert [e.features.shape[0] for e in buffer._entries] == [5, 2] and buffer.num_tokens == 7
    assert torch.equal(buffer._entries[0].tokens, cap.tokens[3, :5])
    assert torch.equal(buffer._entries[1].features, cap.features[1, :2])
    assert {e.step for e in buffer._entries} == {7}


CASES = [(None, Strategy.off(), False), ("ngram", Strategy(4, 1, 5), False), ("eagle", Strategy(3, 2, 6), False),
         ("eagle", Strategy(3, 2, 6), True), ("ngram", Strategy(3, 2, 7), True)]


@pytest.mark.parametrize("kind,strategy,fuse", CASES, ids=lambda v: str(v))
def test_buffered_entries_are_the_requests_sequences_and_features(target, kind, strategy, fuse):
    prompts = ragged_prompts(len(MAX_NEW), seed=0, first=6, step=2)
    pool = GraphPool(backend=FakeGraphBackend(lambda key: 0), warmup_iters=1) if fuse else None
    drafter = EagleDrafter.for_target(target) if kind == "eagle" else kind
    buffer = RolloutBuffer(capacity_tokens=1 << 14, storage_dtype=torch.float32)
    eng = SpeculativeEngine(target, drafter, strategy, pool, max_batch_size=8, max_seq_len=64, fuse_step=fuse,
                            rollout_buffer=buffer)
    if fuse:
        eng.capture_graphs([8])
        assert eng.graph_error is None, eng.graph_error
    out = eng.generate(prompts, MAX_NEW)
    entries = {}
    for entry in buffer._entries:  # requests are told apart by their prompts
        request = next(b for b, p in enumerate(prompts) if entry.tokens[: len(p)].tolist() == p)
        assert request not in entries, f"request {request} buffered twice"
        entries[request] = entry
    stepped = [b for b, n in enumerate(MAX_NEW) if n > 1]  # one token: done at prefill, never stepped
    assert sorted(entries) == stepped
    width = max(strategy.num_verify, 1)
    greedy = reference_generate(target, prompts, max(MAX_NEW) + width)  # past the budgets
    for b in stepped:
        sequence = prompts[b] + out.tokens[b]
        entry = entries[b]
        # The committed context: the output but its last token when that was sampled (the next tree's root, not yet
        # in the cache); a step that ends a request at its budget commits its whole accepted path, a few greedy
        # tokens past the output.
        committed = entry.tokens.shape[0]
        assert len(sequence) - 1 <= committed < len(sequence) + width, f"request {b}"
        assert entry.tokens.tolist() == (prompts[b] + greedy.tokens[b].tolist())[:committed], f"request {b}"
        with torch.no_grad():
            _, hidden = target(entry.tokens.unsqueeze(0))
        torch.testing.assert_close(entry.features, hidden[0], atol=1e-4, rtol=1e-4, msg=f"request {b}")


@pytest.mark.cuda
def test_capture_hands_finished_requests_to_a_pinned_buffer_without_waiting():
    """The engine calls add_to_buffer as requests finish, while the next step runs: the request index goes to the
    device through pinned memory (a pageable copy would wait for the stream to drain), and the buffer's copies
    stay queued behind the busy GPU."""
    gen = torch.Generator().manual_seed(0)
    prompts, hidden = torch.randint(0, 100, (4, 6), generator=gen), torch.randn(4, 6, 16, generator=gen)
    cap = FeatureCapture(prompts.cuda(), hidden.cuda(), 40)
    buffer = RolloutBuffer(capacity_tokens=1 << 12, storage_dtype=torch.float32, pin_memory=True)
    # Once first with the same shapes, as a rollout's first retirements do: a kernel's first launch loads its module,
    # which waits for the device (on the H200 a first two-request hand-over did, after a one-request one had run);
    # the steady state is what must not wait.
    cap.add_to_buffer(buffer, [2, 0], [6, 4], step=0)
    buffer.take()
    torch.cuda._sleep(200_000_000)
    torch.cuda.set_sync_debug_mode("error")
    try:
        cap.add_to_buffer(buffer, [3, 1], [6, 4], step=2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not buffer._entries[0].ready.query()  # queued behind the sleep: nothing waited for it
    taken = buffer.take()
    assert [t.shape[0] for t, _, _ in taken] == [6, 4] and [s for _, _, s in taken] == [2, 2]
    torch.testing.assert_close(taken[0][0], hidden[3])
    torch.testing.assert_close(taken[1][1], prompts[1, :4])


@pytest.mark.cuda
def test_pinned_buffer_adds_without_waiting_and_samples_what_was_added():
    """From CUDA into pinned CPU memory: add returns with the copies in flight (an event marks them), sample
    waits for them and reads the added values."""
    feats = torch.randn(3, 50, 16, device="cuda")
    toks = torch.randint(0, 1000, (3, 50), device="cuda")
    buffer = RolloutBuffer(capacity_tokens=1 << 12, storage_dtype=torch.float32, pin_memory=True)
    torch.cuda._sleep(50_000_000)  # a busy GPU: the copies queue behind it
    buffer.add(feats, toks, step=0, lengths=[50, 20, 31])
    assert all(e.ready is not None and e.features.is_pinned() for e in buffer._entries)
    assert not buffer._entries[0].ready.query()  # add did not wait for the GPU
    batch = buffer.sample(8, 10, generator=torch.Generator().manual_seed(0))
    for r in range(8):
        n = int(batch.valid[r].sum()) + 1
        row = next(b for b in range(3) if torch.equal(batch.tokens[r, :n].cpu(), toks[b].cpu()[
            int(batch.positions[r, 0]): int(batch.positions[r, 0]) + n]))
        start = int(batch.positions[r, 0])
        torch.testing.assert_close(batch.features[r, :n].cpu(), feats[row, start:start + n].cpu())
