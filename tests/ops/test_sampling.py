"""Target-distribution contract (temperature, threshold top-k, threshold top-p) against brute force."""
import math

import pytest
import torch

from tlt_kernels.reference.sampling import greedy_tokens, row_errors, sample_inverse_cdf, target_probs

NEG = float("-inf")


def brute_row(logits, temperature, top_k, top_p):
    """Sort-based, one row, plain Python: the textbook recipe with boundary ties kept."""
    V = len(logits)
    if not temperature:
        best = max(range(V), key=lambda t: (logits[t], -t))
        return [1.0 if t == best else 0.0 for t in range(V)]
    z = [l / temperature for l in logits]
    if top_k and top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [v if v >= kth else NEG for v in z]
    m = max(z)
    e = [math.exp(v - m) if v != NEG else 0.0 for v in z]
    s = sum(e)
    p = [v / s for v in e]
    if top_p is not None and top_p < 1:
        order = sorted(range(V), key=lambda t: -p[t])
        mass, keep = 0.0, set()
        for t in order:
            keep.add(t)
            mass += p[t]
            if mass >= top_p:
                last = p[t]
                keep |= {j for j in range(V) if p[j] == last}
                break
        p = [p[t] if t in keep else 0.0 for t in range(V)]
        s = sum(p)
        p = [v / s for v in p]
    return p


def _check(rows, temperature, top_k, top_p):
    N = len(rows)
    got = target_probs(
        torch.tensor(rows, dtype=torch.float64),
        None if temperature is None else torch.tensor(temperature, dtype=torch.float64),
        None if top_k is None else torch.tensor(top_k),
        None if top_p is None else torch.tensor(top_p, dtype=torch.float64),
    )
    assert got.dtype == torch.float64
    for i in range(N):
        want = brute_row(
            rows[i],
            0 if temperature is None else temperature[i],
            None if top_k is None else top_k[i],
            None if top_p is None else top_p[i],
        )
        torch.testing.assert_close(got[i], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-14)


def test_greedy_is_one_hot_lowest_id_on_ties():
    rows = [[1.0, 3.0, 3.0, -2.0], [NEG, 0.5, NEG, 0.5], [7.0, 7.0, 7.0, 7.0]]
    p = target_probs(torch.tensor(rows), None)
    assert p.argmax(1).tolist() == [1, 1, 0]
    assert (p.sum(1) == 1).all() and ((p == 0) | (p == 1)).all()
    assert greedy_tokens(torch.tensor(rows)).tolist() == [1, 1, 0]
    # temperature 0 in a mixed batch is greedy too.
    _check(rows, [0.0, 1.0, 0.0], None, None)


def test_temperature_softmax():
    rows = [[0.1, -1.2, 2.3, 0.0, 0.7], [1.0, 1.0, NEG, -3.0, 4.0]]
    _check(rows, [1.0, 0.35], None, None)
    _check(rows, [2.5, 1.0], None, None)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6, 7, 0])
def test_top_k_threshold_keeps_boundary_ties(k):
    # Values 5, 3, 3, 3, 1, 0, -inf: k=2..4 all keep the three tied 3s.
    row = [3.0, 1.0, 5.0, 3.0, NEG, 0.0, 3.0]
    _check([row], [1.0], [k], None)
    p = target_probs(torch.tensor([row]), torch.tensor([1.0]), torch.tensor([k]))
    kept = int((p > 0).sum())
    expected = {0: 6, 1: 1, 2: 4, 3: 4, 4: 4, 6: 6, 7: 6}[k]
    assert kept == expected


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.6, 0.75, 0.9, 0.999, 1.0])
def test_top_p_threshold_matches_sort_based(top_p):
    # log-probabilities of 0.4, 0.2, 0.2, 0.1, 0.1 (ties at two boundaries) and a masked token.
    row = [math.log(v) for v in (0.2, 0.4, 0.1, 0.2, 0.1)] + [NEG]
    _check([row], [1.0], None, [top_p])


def test_top_p_boundary_ties_are_kept():
    row = [math.log(v) for v in (0.25, 0.25, 0.25, 0.25)]
    p = target_probs(torch.tensor([row]), torch.tensor([1.0]), None, torch.tensor([0.3]))
    # The mass reaches 0.3 only after two tokens, but all four tie at the threshold.
    assert (p > 0).all()
    row = [math.log(v) for v in (0.5, 0.2, 0.2, 0.1)]
    p = target_probs(torch.tensor([row]), torch.tensor([1.0]), None, torch.tensor([0.6]))
    torch.testing.assert_close(p[0], torch.tensor([5 / 9, 2 / 9, 2 / 9, 0.0], dtype=torch.float64))


def test_random_rows_all_filters(gen):
    N, V = 64, 11
    rows = (torch.randn(N, V, generator=gen) * 2).round(decimals=1)  # rounding creates ties
    rows[torch.rand(N, V, generator=gen) < 0.1] = NEG
    rows[:, 0] = rows[:, 0].clamp(min=-5)  # keep one finite logit per row
    temp = (torch.rand(N, generator=gen) * 2).tolist()
    temp[::7] = [0.0] * len(temp[::7])
    top_k = torch.randint(0, V + 2, (N,), generator=gen).tolist()
    top_p = (torch.rand(N, generator=gen) * 0.9 + 0.1).tolist()
    top_p[::5] = [1.0] * len(top_p[::5])
    _check(rows.tolist(), temp, top_k, top_p)


def test_top_k_then_top_p_order():
    # top-k first (keeps 3 tokens), then top-p over the renormalized kept set.
    row = [math.log(v) for v in (0.3, 0.3, 0.2, 0.1, 0.1)]
    p = target_probs(torch.tensor([row]), torch.tensor([1.0]), torch.tensor([3]), torch.tensor([0.7]))
    torch.testing.assert_close(p[0], torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0], dtype=torch.float64))


def test_row_errors():
    rows = torch.tensor(
        [[0.0, 1.0], [float("nan"), 1.0], [float("inf"), 0.0], [NEG, NEG], [NEG, 2.0]]
    )
    assert row_errors(rows).tolist() == [False, True, True, True, False]


def test_sample_inverse_cdf_token_order_and_zero_mass():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4, dtype=torch.float64)
    u = torch.tensor([1e-7, 0.49, 0.51, 1 - 2**-24])
    assert sample_inverse_cdf(p, u).tolist() == [1, 1, 3, 3]
    # Unnormalized rows, and u * sum rounding past the total falls back to the last positive token.
    p = torch.tensor([[2.0, 0.0, 6.0, 0.0]], dtype=torch.float64)
    assert sample_inverse_cdf(p, torch.tensor([0.2])).tolist() == [0]
    assert sample_inverse_cdf(p, torch.tensor([0.3])).tolist() == [2]
    assert sample_inverse_cdf(p, torch.tensor([1.0])).tolist() == [2]
