"""The shared input checks: device comparison and the contiguity boundary."""
import pytest
import torch

from tlt_kernels import _validation
from tlt_kernels._validation import dense, devices_equal


def test_cuda_without_index_is_the_current_device_even_before_cuda_starts(monkeypatch):
    """'cuda' and 'cuda:<current>' are one device, also before the process's first CUDA call (a cache built with
    device='cuda' compared with a model on cuda:0)."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert devices_equal("cuda", "cuda:0") and devices_equal(torch.device("cuda", 0), "cuda")
    assert not devices_equal("cuda", "cuda:1") and not devices_equal("cuda", "cpu")
    assert devices_equal("cuda:1", "cuda:1") and not devices_equal("cuda:0", "cuda:1")


def test_without_a_gpu_cuda_is_compared_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _validation._normalize("cuda") == torch.device("cuda")
    assert devices_equal("cpu", torch.device("cpu"))


def test_dense_copies_only_views():
    t = torch.arange(12).reshape(3, 4)
    assert dense(t) is t and dense(None) is None
    view = t.t()
    out = dense(view)
    assert out.is_contiguous() and torch.equal(out, view) and out.data_ptr() != t.data_ptr()
    expanded = torch.tensor([5]).expand(4)
    assert dense(expanded).stride() == (1,) and dense(expanded).tolist() == [5, 5, 5, 5]


def test_narrowing_integer_casts_saturate():
    from tlt_kernels._validation import saturate_to

    big = torch.tensor([2**32 + 3, -(2**40), 7], dtype=torch.int64)
    assert saturate_to(big, torch.int32).tolist() == [2**31 - 1, -(2**31), 7]
    assert saturate_to(torch.tensor([300, -5], dtype=torch.int32), torch.uint8).tolist() == [255, 0]
    same = torch.tensor([1, 2], dtype=torch.int32)
    assert saturate_to(same, torch.int32) is same
    assert saturate_to(torch.tensor([1.5]), torch.float64).dtype == torch.float64


def test_wrapped_counts_are_out_of_range_not_plausible():
    """num_nodes / context_lens past int32 used to wrap to small, valid-looking values (2**32 + 3 -> 3)."""
    import pytest

    import tlt_kernels as tlt

    parents = torch.tensor([[-1, 0, 1, 2]], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_nodes"):
        tlt.validate_tree(parents, torch.tensor([2**32 + 3]))
    with pytest.raises(ValueError, match="context_lens"):
        tlt.plan_tree_attention(parents, torch.tensor([2**32 + 5]), torch.zeros(1, 4, dtype=torch.int32),
                                num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=4)


def test_check_real_takes_finite_numbers_in_range_and_names_the_argument():
    from tlt_kernels._validation import check_real

    assert check_real("Where", "x", 3, 1.0) == 3.0 and check_real("Where", "x", 0.5, 0.0, 1.0) == 0.5
    for value, kw in [(0.0, dict(low=0.0, strict=True)), (1.5, dict(low=0.0, high=1.0)), (True, dict(low=0.0)),
                      (float("inf"), dict(low=0.0)), (float("nan"), dict(low=0.0)), ("1", dict(low=0.0)),
                      (-1, dict(low=0.0))]:
        with pytest.raises(ValueError, match="Where: x must be a finite number"):
            check_real("Where", "x", value, **kw)
