"""The draft's and commit's kept constants: made once per arguments outside graph capture and never freed (a captured
graph reads them by address), made afresh inside a capture or a compilation."""
import pytest
import torch

from tlt_kernels.drafter import constants

CPU = torch.device("cpu")


def test_values():
    for n in (0, 1, 5, 8, 9, 300):
        assert constants.arange(n, CPU).tolist() == list(range(n))
    assert constants.node_bits(32, torch.int32, CPU).tolist() == [1 << j for j in range(31)] + [-(1 << 31)]
    assert constants.node_bits(40, torch.int64, CPU).tolist() == [1 << j for j in range(40)]
    mask = constants.causal_mask(5, CPU)
    assert mask.dtype == torch.int32 and mask.shape == (1, 5, 1) and mask[0, :, 0].tolist() == [1, 3, 7, 15, 31]
    wide = constants.causal_mask(40, CPU)  # two int32 words a row past 32 pairs
    assert wide.shape == (1, 40, 2) and wide[0, 39].tolist() == [-1, (1 << 8) - 1]
    full = constants.full(3, -1, torch.int64, CPU)
    assert full.dtype == torch.int64 and full.tolist() == [-1] * 3


def test_kept_and_bounded_in_kind():
    """Kept tensors are handed out again, never remade; an arange is a view of the next power of two's, so the kept
    ones stay few whatever the sizes asked (nothing kept is ever freed: no eviction)."""
    assert constants._arange_pow2.cache_info().maxsize is None
    before = constants._arange_pow2.cache_info().currsize
    for n in range(1, 65):
        constants.arange(n, CPU)
    assert constants._arange_pow2.cache_info().currsize - before <= 7  # 1, 2, 4, ..., 64
    ptr = constants.arange(9, CPU).data_ptr()
    assert all(constants.arange(n, CPU).data_ptr() == ptr for n in range(9, 17))
    assert constants.arange(17, CPU).data_ptr() != ptr
    assert constants.causal_mask(6, CPU) is constants.causal_mask(6, CPU)


@pytest.mark.parametrize("inside", ["capture", "compile"])
def test_made_afresh_inside_capture_and_compilation(monkeypatch, inside):
    """A constant made during a capture holds its values only once its graph replays, and a fake tensor of a trace
    must not outlive it: neither is kept, and nothing kept is handed out there."""
    kept = constants.causal_mask(4, CPU)
    if inside == "capture":
        monkeypatch.setattr(constants, "capturing", lambda device: True)
    else:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    before = constants.causal_mask.cache_info()
    made = constants.causal_mask(4, CPU)
    assert made is not kept and torch.equal(made, kept)
    assert torch.equal(constants.causal_mask(3, CPU), kept[:, :3])
    assert constants.causal_mask.cache_info() == before
