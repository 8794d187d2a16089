"""The draft's and commit's kept constants: made once per arguments outside graph capture, made afresh inside it."""
import pytest
import torch

from tlt_kernels.drafter import constants

CPU = torch.device("cpu")


def test_values():
    assert constants.arange(5, CPU).tolist() == [0, 1, 2, 3, 4]
    assert constants.node_bits(32, torch.int32, CPU).tolist() == [1 << j for j in range(31)] + [-(1 << 31)]
    assert constants.node_bits(40, torch.int64, CPU).tolist() == [1 << j for j in range(40)]
    mask = constants.causal_mask(2, 5, CPU)
    assert mask.dtype == torch.int32 and mask.shape == (2, 5, 1)
    assert mask[:, :, 0].tolist() == [[1, 3, 7, 15, 31]] * 2
    assert constants.causal_mask(1, 40, CPU).shape == (1, 40, 2)  # two int32 words past 32 pairs
    full = constants.full((2, 3), -1, torch.int64, CPU)
    assert full.dtype == torch.int64 and full.tolist() == [[-1] * 3] * 2


def test_kept_outside_capture():
    constants.arange.cache_clear()
    first = constants.arange(7, CPU)
    assert constants.arange(7, CPU) is first
    assert constants.arange(8, CPU) is not first
    info = constants.arange.cache_info()
    assert (info.hits, info.misses) == (1, 2)


@pytest.mark.parametrize("inside", ["capture", "compile"])
def test_made_afresh_inside_capture_and_compilation(monkeypatch, inside):
    """A constant made during a capture holds its values only once its graph replays, and a fake tensor of a trace
    must not outlive it: neither is kept, and nothing kept is handed out there."""
    constants.causal_mask.cache_clear()
    kept = constants.causal_mask(3, 4, CPU)
    if inside == "capture":
        monkeypatch.setattr(constants, "capturing", lambda device: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    before = constants.causal_mask.cache_info()
    made = constants.causal_mask(3, 4, CPU)
    assert made is not kept and torch.equal(made, kept)
    assert constants.causal_mask(3, 5, CPU) is not None
    assert constants.causal_mask.cache_info() == before
