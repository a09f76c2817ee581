"""The public filter functions of `actors.engine.sampling`: exact supports, batching, validation."""

import math

import pytest
import torch

from actors.engine.sampling_filters import min_p_filter, top_k_filter, top_p_filter, typical_filter
from tests.helpers.sampling import support

# --- Filters: exact supports. ---


@pytest.mark.parametrize(
    "p, kept",
    [(0.8, {0, 1}), (0.81, {0, 1, 2}), (0.5, {0}), (0.5000001, {0, 1}), (1.0, {0, 1, 2})],
)
def test_top_p_keeps_boundary_token(p, kept):
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert support(top_p_filter(probs, p)) == kept


def test_top_p_unsorted_input_and_ties_by_id():
    assert support(top_p_filter(torch.tensor([0.2, 0.5, 0.3]), 0.8)) == {1, 2}
    assert support(top_p_filter(torch.full((4,), 0.25), 0.5)) == {0, 1}
    assert support(top_p_filter(torch.full((4,), 0.25), 0.51)) == {0, 1, 2}


def test_top_k_ties_broken_by_lower_id():
    probs = torch.tensor([0.2, 0.3, 0.2, 0.3])
    assert support(top_k_filter(probs, 1)) == {1}
    assert support(top_k_filter(probs, 2)) == {1, 3}
    assert support(top_k_filter(probs, 3)) == {0, 1, 3}
    assert support(top_k_filter(probs, 10)) == {0, 1, 2, 3}
    assert torch.allclose(top_k_filter(probs, 3), torch.tensor([0.25, 0.375, 0.0, 0.375]))


def test_min_p_threshold_is_inclusive():
    probs = torch.tensor([0.125, 0.5, 0.25, 0.125])
    assert support(min_p_filter(probs, 0.5)) == {1, 2}
    assert support(min_p_filter(probs, 0.25)) == {0, 1, 2, 3}
    assert support(min_p_filter(probs, 0.26)) == {1, 2}
    assert support(min_p_filter(probs, 1.0)) == {1}
    assert support(min_p_filter(probs, 0.0)) == {0, 1, 2, 3}


def test_typical_can_exclude_the_most_likely_token():
    # H = 1.332 nats; -log 0.4 = 0.916 is further from H than -log 0.2 = 1.609.
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    assert support(typical_filter(probs, 0.5)) == {1, 2, 3}
    assert support(typical_filter(probs, 0.2)) == {1}
    assert support(typical_filter(probs, 0.61)) == {0, 1, 2, 3}
    assert torch.allclose(typical_filter(probs, 0.5), torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3]))


def test_typical_ranks_zero_probability_tokens_last():
    probs = torch.tensor([0.0, 0.7, 0.3, 0.0])
    out = typical_filter(probs, 0.99)
    assert support(out) == {1, 2}
    assert math.isclose(out.sum().item(), 1.0, abs_tol=1e-6)


def test_filter_order_matters():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    k_then_p = top_p_filter(top_k_filter(probs, 2), 0.5)  # [0.571, 0.429]: 0.571 alone reaches 0.5
    p_then_k = top_k_filter(top_p_filter(probs, 0.5), 2)  # 0.4 < 0.5, so the nucleus is {0, 1}
    assert support(k_then_p) == {0}
    assert support(p_then_k) == {0, 1}


def random_probs(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)


@pytest.mark.parametrize(
    "fn, values",
    [
        (top_k_filter, [1, 3, 7, 50]),
        (top_p_filter, [0.1, 0.5, 0.9, 1.0]),
        (min_p_filter, [0.0, 0.05, 0.3, 1.0]),
        (typical_filter, [0.2, 0.5, 0.95, 1.0]),
    ],
)
def test_batched_matches_rows_and_renormalizes(fn, values):
    probs = random_probs(len(values), 50, seed=1)
    per_row = torch.tensor(values)
    batched = fn(probs, per_row)
    assert batched.shape == probs.shape
    for i, v in enumerate(values):
        single = fn(probs[i], v)
        assert support(batched[i]) == support(single)
        torch.testing.assert_close(batched[i], single)
        assert math.isclose(single.sum().item(), 1.0, abs_tol=1e-5)
    # A scalar applies to every row.
    scalar = fn(probs, values[1])
    for i in range(len(values)):
        assert support(scalar[i]) == support(fn(probs[i], values[1]))


def reference_nucleus(probs: torch.Tensor, p: float) -> set[int]:
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    kept, before = set(), 0.0
    for i in ranked:
        if before >= p:
            break
        kept.add(i)
        before += probs[i].item()
    return kept


@pytest.mark.parametrize("scale, p", [(8.0, 0.9), (8.0, 0.3), (0.5, 0.9), (0.5, 0.05)])
def test_top_p_on_large_vocab_matches_reference(scale, p):
    # 3000 tokens: a peaked row keeps few, a flat row keeps more than the 1024 largest.
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(scale * torch.randn(3000, generator=g, dtype=torch.float64), dim=-1)
    expected = reference_nucleus(probs, p)
    assert support(top_p_filter(probs, p)) == expected
    assert (len(expected) > 1024) == (scale == 0.5 and p == 0.9)


def test_top_p_ties_across_a_large_vocab():
    probs = torch.full((2, 2048), 1 / 2048)
    out = top_p_filter(probs, torch.tensor([0.5, 0.25]))
    assert support(out[0]) == set(range(1024))
    assert support(out[1]) == set(range(512))


def test_top_k_with_fewer_nonzero_tokens_than_k():
    probs = torch.tensor([0.0, 0.75, 0.0, 0.25, 0.0])
    assert support(top_k_filter(probs, 3)) == {1, 3}
    assert support(top_k_filter(probs, 1)) == {1}


def test_filters_never_keep_more_than_asked():
    probs = random_probs(8, 100, seed=2)
    assert (top_k_filter(probs, 5) > 0).sum(dim=-1).tolist() == [5] * 8


@pytest.mark.parametrize(
    "fn, bad",
    [
        (top_k_filter, 0),
        (top_k_filter, -3),
        (top_k_filter, 2.5),
        (top_k_filter, torch.tensor([1, 0])),
        (top_p_filter, 0.0),
        (top_p_filter, 1.5),
        (top_p_filter, float("nan")),
        (top_p_filter, torch.tensor([0.5, 0.5, 0.5])),  # 3 values for 2 rows
        (min_p_filter, -0.1),
        (min_p_filter, 1.01),
        (typical_filter, 0.0),
        (typical_filter, 2.0),
    ],
)
def test_filter_parameter_validation(fn, bad):
    with pytest.raises(ValueError):
        fn(torch.full((2, 4), 0.25), bad)


@pytest.mark.parametrize("probs", [torch.full((1, 2, 2), 0.25), torch.tensor(1.0), torch.tensor([1, 0])])
def test_filter_rejects_bad_probs(probs):
    with pytest.raises(ValueError):
        top_p_filter(probs, 0.5)
