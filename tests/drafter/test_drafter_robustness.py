"""Issue 26 ("no silent wrong answers") for the drafters and the rollout buffer: state overflows and misuse raise
clear errors instead of wrapping, going negative or counting tokens that were never written; the drafter-quality
estimate is not poisoned by a garbage measurement; corrupt checkpoints are named."""
import math
import warnings

import pytest
import torch

from tlt_kernels.drafter import (
    DrafterKVCache,
    EagleConfig,
    EagleDrafter,
    NGramDrafter,
    RolloutBuffer,
    SpotTrainer,
)
from tlt_kernels.drafter.spot_trainer import DrafterQuality, evaluate_acceptance
from tlt_kernels.models.config import ModelConfig
from tlt_kernels.models.llama import LlamaForCausalLM


def _drafter(vocab=64):
    torch.manual_seed(0)
    tgt = LlamaForCausalLM(ModelConfig.tiny(vocab_size=vocab)).eval()
    return tgt, EagleDrafter.for_target(tgt, seed=0).eval()


def _pairs(d, B, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, n, d.config.hidden_size, generator=g), torch.randint(0, 64, (B, n), generator=g)


# -- EagleDrafter.extend ------------------------------------------------------------------------------------------
def test_extend_past_the_block_table_raises_and_leaves_the_cache_alone():
    _, d = _drafter()
    cache = DrafterKVCache(d.config, 1 + 2 * d.blocks_per_request(8, 4), block_size=4)
    st = d.new_state(cache, 2, 8)  # 8 slots per request, and the scratch past them
    f, t = _pairs(d, 2, 6)
    d.extend(st, cache, f, t, torch.tensor([6, 3], dtype=torch.int32))
    k_before, ctx_before = cache.k.clone(), st.context_lens.clone()
    f2, t2 = _pairs(d, 2, 4, seed=1)
    with pytest.raises(ValueError, match=r"request 0 holds context_lens = 6 pairs and adds num_new = 4, past the 8 slots"):
        d.extend(st, cache, f2, t2, torch.tensor([4, 4], dtype=torch.int32))  # 6 + 4 > 8 would wrap into slot 0..1
    assert torch.equal(cache.k, k_before) and torch.equal(st.context_lens, ctx_before)
    d.extend(st, cache, f2, t2, torch.tensor([2, 4], dtype=torch.int32))  # exactly full: fine
    assert st.context_lens.tolist() == [8, 7]


@pytest.mark.parametrize("num_new,why", [([-1, 2], r"num_new\[0\] = -1 is outside \[0, n=3\]"),
                                         ([1, 4], r"num_new\[1\] = 4 is outside \[0, n=3\]")])
def test_extend_rejects_counts_outside_the_given_pairs(num_new, why):
    _, d = _drafter()
    cache = DrafterKVCache(d.config, 1 + 2 * d.blocks_per_request(8, 4), block_size=4)
    st = d.new_state(cache, 2, 8)
    f, t = _pairs(d, 2, 3)
    with pytest.raises(ValueError, match=why):
        d.extend(st, cache, f, t, torch.tensor(num_new, dtype=torch.int32))
    assert st.context_lens.tolist() == [0, 0]


def test_extend_validate_false_skips_the_host_check(monkeypatch):
    import tlt_kernels.drafter.eagle as eagle

    _, d = _drafter()
    cache = DrafterKVCache(d.config, 1 + 2 * d.blocks_per_request(8, 4), block_size=4)
    st = d.new_state(cache, 2, 8)
    calls = []
    monkeypatch.setattr(eagle, "_check_extend", lambda *a: calls.append(a))
    f, t = _pairs(d, 2, 3)
    d.extend(st, cache, f, t, torch.tensor([3, 1], dtype=torch.int32), validate=False)
    assert calls == []
    d.extend(st, cache, f, t, torch.tensor([0, 1], dtype=torch.int32))
    assert len(calls) == 1


@pytest.mark.parametrize("kw,why", [(dict(block_size=0), "block_size must be an int >= 1, got 0"),
                                    (dict(block_size=2.5), "block_size must be an int >= 1, got 2.5"),
                                    (dict(num_blocks=1), "num_blocks must be an int >= 2")])
def test_drafter_cache_arguments(kw, why):
    _, d = _drafter()
    args = dict(num_blocks=8, block_size=4)
    args.update(kw)
    with pytest.raises(ValueError, match=why):
        DrafterKVCache(d.config, **args)


def test_drafter_cache_allocation_and_double_free():
    _, d = _drafter()
    cache = DrafterKVCache(d.config, 8, block_size=4)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        cache.allocate(2, 0)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got -1"):
        cache.allocate(-1, 4)
    table = cache.allocate(2, 8)
    cache.free(table)
    with pytest.raises(ValueError, match="double free"):
        cache.free(table)  # a block on the free list twice would be handed to two requests
    assert cache.num_free_blocks == 7
    with pytest.raises(ValueError, match="out-of-range"):
        cache.free(torch.tensor([[9]], dtype=torch.int32))
    cache.free(torch.zeros(2, 3, dtype=torch.int32))  # padding rows point at the sink block 0: nothing to free
    assert cache.num_free_blocks == 7


def test_eagle_config_fields():
    base = dict(vocab_size=64, hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    for key, bad, why in [("num_kv_heads", 0, "num_kv_heads must be a positive int, got 0"),
                          ("head_dim", 7, "head_dim must be even"),
                          ("rope_theta", float("nan"), "rope_theta must be a finite number > 0")]:
        with pytest.raises(ValueError, match=why):
            EagleConfig(**dict(base, **{key: bad}))


def test_evaluate_acceptance_block_size():
    _, d = _drafter()
    f, t = _pairs(d, 1, 12)
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        evaluate_acceptance(d, f, t, depth=2, topk=2, num_verify=4, block_size=0)


# -- NGramDrafter -----------------------------------------------------------------------------------------------
def _ngram():
    ng = NGramDrafter(3, 16)
    ng.reset([0, 1, 2], torch.arange(12).view(3, 4), torch.tensor([4, 2, 3]))
    return ng


@pytest.mark.parametrize("slots,lens,why", [
    ([-1], [2], r"slot -1 is outside \[0, batch_size=3\)"),
    ([3], [2], r"slot 3 is outside \[0, batch_size=3\)"),
    ([1, 1], [2, 2], "slots must be distinct"),
    ([1], [5], r"prompt_lens\[0\] = 5 is outside \[0, 4\]"),
    ([1], [-2], r"prompt_lens\[0\] = -2 is outside \[0, 4\]"),
])
def test_ngram_reset_checks_slots_and_lengths(slots, lens, why):
    ng = _ngram()
    before = (ng.buffer.clone(), ng.lengths.clone())
    prompts = torch.arange(4 * len(slots)).view(len(slots), 4) + 100
    with pytest.raises(ValueError, match=why):
        ng.reset(slots, prompts, torch.tensor(lens))
    assert torch.equal(ng.buffer, before[0]) and torch.equal(ng.lengths, before[1])


@pytest.mark.parametrize("num,why", [([1, 3, 0], r"num_new\[1\] = 3 is outside \[0, 2\]"),
                                     ([0, 0, -1], r"num_new\[2\] = -1 is outside \[0, 2\]")])
def test_ngram_append_checks_counts(num, why):
    ng = _ngram()
    lens = ng.lengths.clone()
    with pytest.raises(ValueError, match=why):
        ng.append(torch.full((3, 2), 7), torch.tensor(num, dtype=torch.int32))
    assert torch.equal(ng.lengths, lens)
    ng.append(torch.full((3, 2), 7), torch.tensor([2, 0, 1], dtype=torch.int32))
    assert ng.lengths.tolist() == [6, 2, 4]


def test_ngram_append_validate_false_is_pure_device_work(monkeypatch):
    import tlt_kernels.drafter.ngram_drafter as mod

    ng = _ngram()
    monkeypatch.setattr(mod, "_check_counts", lambda *a: pytest.fail("validate=False must not read num_new on the host"))
    ng.append(torch.full((3, 2), 7), torch.tensor([2, 1, 0], dtype=torch.int32), validate=False)
    assert ng.lengths.tolist() == [6, 3, 3]


def test_ngram_constructor_arguments():
    with pytest.raises(ValueError, match=r"backend='bogus' is not one of \('auto', 'torch', 'triton', 'cuda'\)"):
        NGramDrafter(2, 8, backend="bogus")
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        NGramDrafter(2, 0)


# -- RolloutBuffer ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths,why", [([3, 9], r"lengths\[1\] = 9 is outside \[0, n=5\]"),
                                         ([3, -1], r"lengths\[1\] = -1 is outside \[0, n=5\]"),
                                         ([3], "lengths has 1 entries, expected one per row"),
                                         ([3, 2.5], r"lengths\[1\] = 2.5 is outside")])
def test_buffer_lengths_cannot_exceed_the_stored_positions(lengths, why):
    buf = RolloutBuffer(1000)
    feats, toks = torch.randn(2, 5, 8), torch.randint(0, 64, (2, 5))
    lens = torch.tensor(lengths) if all(isinstance(v, int) for v in lengths) else lengths
    with pytest.raises(ValueError, match=why):
        buf.add(feats, toks, step=0, lengths=lens)
    assert buf.num_tokens == 0 and len(buf) == 0
    buf.add(feats, toks, step=0, lengths=torch.tensor([5, 2]))
    assert buf.num_tokens == sum(e.features.shape[0] for e in buf._entries) == 7


def test_buffer_sample_arguments():
    buf = RolloutBuffer(1000)
    buf.add(torch.randn(6, 8), torch.randint(0, 64, (6,)), step=0)
    with pytest.raises(ValueError, match="seq_len must be an int >= 1, got 0"):
        buf.sample(2, 0)


# -- DrafterQuality and checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("garbage", [[math.nan, 2.0], [], [math.inf], [-1.0, 3.0]])
def test_drafter_quality_ignores_garbage(garbage):
    q = DrafterQuality(weak_below=1.5)
    q.record([1.2, 1.1])
    assert q.is_weak
    with pytest.warns(RuntimeWarning, match="DrafterQuality.record ignored"):
        q.record(garbage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per estimator
        q.record(garbage, version=3)
    assert q.rejected == 2 and q.value == pytest.approx(1.15) and q.is_weak and 3 not in q.by_version
    q.record([3.0] * 4)
    assert math.isfinite(q.value)


def test_spot_trainer_checkpoint_errors_name_the_file(tmp_path):
    _, d = _drafter()
    buf = RolloutBuffer(1000)
    tr = SpotTrainer(d, buf, batch_size=1, seq_len=4)
    corrupt = tmp_path / "ckpt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="ckpt.pt is not a readable SpotTrainer checkpoint"):
        tr.load_checkpoint(str(corrupt))
    other = tmp_path / "other.pt"
    torch.save({"drafter": d.state_dict()}, other)
    with pytest.raises(ValueError, match=r"other.pt is not a SpotTrainer checkpoint: missing \['optimizer'"):
        tr.load_checkpoint(str(other))
    good = tmp_path / "good.pt"
    tr.save_checkpoint(str(good))
    tr.load_checkpoint(str(good))


def test_draft_topk_above_the_vocabulary():
    _, d = _drafter(vocab=64)
    cache = DrafterKVCache(d.config, 1 + 1 * d.blocks_per_request(8, 4), block_size=4)
    st = d.new_state(cache, 1, 8)
    with pytest.raises(ValueError, match=r"topk <= vocab_size=64, got depth=2, topk=65"):
        d.draft(st, cache, depth=2, topk=65, num_verify=4)


def test_intermediate_size_zero_is_not_read_as_absent():
    tgt, _ = _drafter()
    with pytest.raises(ValueError, match="intermediate_size must be a positive int, got 0"):
        EagleDrafter.for_target(tgt, intermediate_size=0)
    assert EagleDrafter.for_target(tgt, intermediate_size=32).config.intermediate_size == 32
