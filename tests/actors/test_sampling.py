import math

import pytest
import torch
from scipy.stats import chisquare

from actors.sampling import (
    Sampler,
    SamplingRow,
    min_p_filter,
    new_generator,
    top_k_filter,
    top_p_filter,
    typical_filter,
)
from actors.sampling_params import SamplingParams

EOS = 0
NEG_INF = float("-inf")


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())


def make_row(prompt=(5,), output=(), **params) -> SamplingRow:
    sp = SamplingParams(**params)
    generator = new_generator(sp.seed) if sp.seed is not None else None
    return SamplingRow(sp, list(prompt), list(output), generator)


def tokens(results) -> list[int]:
    return [r.token_id for r in results]


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


# --- Sampler: draws follow the filtered distribution. ---

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, -3.0])


@pytest.mark.parametrize(
    "params, kept",
    [
        (dict(temperature=0.7, top_p=0.8), {0, 1, 2}),
        (dict(temperature=1.3, top_k=5, min_p=0.3), {0, 1, 2, 3}),
        (dict(temperature=1.0, typical_p=0.45), {1, 2, 3}),
    ],
)
def test_draws_match_filtered_distribution(params, kept):
    probs = torch.softmax(LOGITS / params["temperature"], dim=-1)
    if "top_k" in params:
        probs = top_k_filter(probs, params["top_k"])
    if "top_p" in params:
        probs = top_p_filter(probs, params["top_p"])
    if "min_p" in params:
        probs = min_p_filter(probs, params["min_p"])
    if "typical_p" in params:
        probs = typical_filter(probs, params["typical_p"])
    assert support(probs) == kept

    draws = 20000
    rows = [make_row(**params) for _ in range(draws)]
    sampled = torch.tensor(tokens(Sampler(8, [EOS], seed=3)(LOGITS.expand(draws, -1).clone(), rows)))
    counts = torch.bincount(sampled, minlength=8)
    outside = [t for t in range(8) if t not in kept]
    assert counts[outside].sum().item() == 0
    inside = sorted(kept)
    expected = probs[inside].double()
    expected = expected / expected.sum() * draws  # chisquare wants equal totals to 1e-8
    assert chisquare(counts[inside].double().numpy(), expected.numpy()).pvalue > 0.001


# --- Greedy. ---


def test_greedy_ties_go_to_lowest_index_fast_and_general_path():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [4.0, 4.0, 4.0, 4.0], [0.0, 1.0, 5.0, 5.0]])
    sampler = Sampler(4, [EOS])
    fast = sampler(logits, [make_row(temperature=0.0) for _ in range(3)])
    assert tokens(fast) == [1, 0, 2]
    assert all(r.logprob is None and r.top_logprobs is None for r in fast)
    rows = [make_row(temperature=0.0, logprobs=0), make_row(temperature=0.0), make_row(temperature=0.0, presence_penalty=0.5)]
    general = sampler(logits, rows)
    assert tokens(general) == [1, 0, 2]


def test_greedy_with_penalties_and_mixed_batch():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0], [2.0, 1.9, 0.0, -1.0]])
    rows = [
        make_row(prompt=[0], temperature=0.0, repetition_penalty=1.5),  # 2/1.5 = 1.33 < 1.9
        make_row(prompt=[3], output=[1], temperature=1.0, top_k=1, frequency_penalty=0.5),  # 1.4 < 2
    ]
    assert tokens(Sampler(4, [EOS])(logits, rows)) == [1, 0]


# --- Constraints and penalties: exact logits. ---


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 0.0]])
    row = make_row(prompt=[0, 4], output=[1, 1], repetition_penalty=2.0)
    out = Sampler(5, [EOS]).adjust_logits(logits, [row])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5, 0.0]]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5, 0.0]]  # the input is untouched


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    row = make_row(prompt=[0, 0], output=[2, 2, 2, 3], frequency_penalty=0.5, presence_penalty=0.25)
    out = Sampler(4, [EOS]).adjust_logits(logits, [row])
    assert out.tolist() == [[1.0, 1.0, 1.0 - 1.5 - 0.25, 1.0 - 0.5 - 0.25]]


def test_repetition_then_frequency_order():
    logits = torch.tensor([[3.0, -1.0]])
    row = make_row(prompt=[], output=[0, 1], repetition_penalty=1.5, frequency_penalty=1.0)
    out = Sampler(2, [EOS]).adjust_logits(logits, [row])
    assert out.tolist() == [[3.0 / 1.5 - 1.0, -1.5 - 1.0]]


def test_rows_without_adjustments_share_the_input():
    logits = torch.zeros(2, 4)
    assert Sampler(4, [EOS]).adjust_logits(logits, [make_row(), make_row(top_p=0.5)]) is logits


def test_logit_bias_forces_token_and_allowed_ids_restrict():
    logits = torch.zeros(4, 6)
    rows = [
        make_row(logit_bias={3: 100.0}),
        make_row(logit_bias={3: 100.0}, temperature=0.0),
        make_row(allowed_token_ids=(2, 5)),
        make_row(allowed_token_ids=(2, 5), logit_bias={5: -1.0, 1: 50.0}),
    ]
    sampler = Sampler(6, [EOS])
    adjusted = sampler.adjust_logits(logits, rows)
    assert adjusted[2].tolist() == [NEG_INF, NEG_INF, 0.0, NEG_INF, NEG_INF, 0.0]
    assert adjusted[3].tolist() == [NEG_INF, NEG_INF, 0.0, NEG_INF, NEG_INF, -1.0]  # bias cannot re-allow
    drawn = tokens(sampler(torch.zeros(800, 6), rows * 200))
    seen = [set(drawn[i::4]) for i in range(4)]
    assert seen[0] == {3} and seen[1] == {3}
    assert seen[2] == {2, 5} and seen[3] == {2, 5}


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 1.0, 2.0]])
    sampler = Sampler(5, eos_token_ids=[0, 3])
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=(1,))
    before = make_row(output=[4], **params)
    assert sampler.adjust_logits(logits, [before]).tolist() == [[NEG_INF, NEG_INF, 3.0, NEG_INF, 2.0]]
    assert tokens(sampler(logits, [before])) == [2]
    reached = make_row(output=[4, 4], **params)
    assert sampler.adjust_logits(logits, [reached]) is logits
    assert tokens(sampler(logits, [reached])) == [0]


# --- Seeds. ---


def run_seeded(batch_builder, sampler_seed: int, steps=20) -> list[int]:
    """Tokens drawn for the row seeded 123 over `steps` calls; batch_builder places it in a batch."""
    target = make_row(seed=123, top_p=0.95)
    sampler = Sampler(1000, [EOS], seed=sampler_seed)
    drawn = []
    for _ in range(steps):
        rows, position = batch_builder(target)
        g = torch.Generator().manual_seed(len(drawn))
        logits = torch.randn(len(rows), 1000, generator=g)
        logits[position] = torch.linspace(0.0, 1.0, 1000)
        drawn.append(sampler(logits, rows)[position].token_id)
    return drawn


def alone(target):
    return [target], 0


def third_of_five(target):
    return [make_row(), make_row(seed=7), target, make_row(temperature=0.0), make_row(top_k=3)], 2


def first_of_three(target):
    return [target, make_row(seed=123, top_p=0.95), make_row(min_p=0.1)], 0


def test_seeded_row_ignores_its_batch():
    reference = run_seeded(alone, sampler_seed=0)
    assert len(set(reference)) > 10  # really random draws
    assert run_seeded(third_of_five, sampler_seed=1) == reference
    assert run_seeded(first_of_three, sampler_seed=2) == reference


def test_different_seed_differs_and_unseeded_rows_use_sampler_seed():
    logits = torch.linspace(0.0, 1.0, 1000).expand(20, -1)
    a = tokens(Sampler(1000, [EOS])(logits, [make_row(seed=1) for _ in range(20)]))
    b = tokens(Sampler(1000, [EOS])(logits, [make_row(seed=2) for _ in range(20)]))
    assert a != b
    assert len(set(a)) == 1  # 20 rows with the same seed draw the same token
    u1 = tokens(Sampler(1000, [EOS], seed=5)(logits, [make_row() for _ in range(20)]))
    u2 = tokens(Sampler(1000, [EOS], seed=5)(logits, [make_row() for _ in range(20)]))
    u3 = tokens(Sampler(1000, [EOS], seed=6)(logits, [make_row() for _ in range(20)]))
    assert u1 == u2 and u1 != u3
    assert len(set(u1)) > 10


# --- Logprobs. ---


def test_logprobs_come_from_raw_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    rows = [
        make_row(output=[1, 2], temperature=0.5, repetition_penalty=1.7, top_k=5, logprobs=3),
        make_row(temperature=0.0, logit_bias={7: 30.0}, logprobs=0),
        make_row(),
    ]
    results = Sampler(50, [EOS])(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert results[1].token_id == 7
    for i in (0, 1):
        assert results[i].logprob == pytest.approx(raw[i, results[i].token_id].item(), abs=1e-6)
    best = raw[0].argsort(descending=True)[:3].tolist()
    assert [t for t, _ in results[0].top_logprobs] == best
    assert [v for _, v in results[0].top_logprobs] == pytest.approx(raw[0, best].tolist(), abs=1e-6)
    assert results[1].top_logprobs == []
    assert results[2].logprob is None and results[2].top_logprobs is None


def test_top_logprobs_ties_go_to_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [1.0, 3.0, 3.0, 2.0, 3.0]])
    rows = [make_row(temperature=0.0, logprobs=2), make_row(temperature=0.0, logprobs=4)]
    results = Sampler(5, [EOS])(logits, rows)
    assert [t for t, _ in results[0].top_logprobs] == [1, 2]
    assert [t for t, _ in results[1].top_logprobs] == [1, 2, 4, 3]
    tied = results[1].top_logprobs[0][1]
    assert [v for _, v in results[1].top_logprobs[:3]] == [tied] * 3
    assert tied > results[1].top_logprobs[3][1]


def test_top_logprobs_ties_across_the_cut():
    # Many tokens share the best logit; torch.topk alone would return an arbitrary subset of them.
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (1, 50), generator=g).float()
    result = Sampler(50, [EOS])(logits, [make_row(temperature=0.0, logprobs=5)])[0]
    expected = sorted(range(50), key=lambda i: (-logits[0, i].item(), i))[:5]
    assert (logits[0] == 2).sum().item() > 5
    assert [t for t, _ in result.top_logprobs] == expected
    assert result.token_id == expected[0]


def test_sampler_rejects_mismatched_logits():
    with pytest.raises(ValueError):
        Sampler(4, [EOS])(torch.zeros(2, 4), [make_row()])
    with pytest.raises(ValueError):
        Sampler(8, [EOS])(torch.zeros(1, 4), [make_row()])
    with pytest.raises(ValueError):
        Sampler(4, [9])


def test_params_with_logit_bias_stay_hashable_and_finite():
    bias = {3: 2.0}
    params = SamplingParams(logit_bias=bias)
    bias[3] = 50.0  # the caller's dict is not the params' dict
    assert params.logit_bias == {3: 2.0}
    assert hash(params) == hash(SamplingParams(logit_bias={3: 2.0}))
    with pytest.raises(ValueError):
        SamplingParams(logit_bias={3: float("inf")})


def test_extreme_temperature_is_the_greedy_limit():
    """logits / T overflowing to inf must not poison the draw (it once sampled an out-of-vocab id)."""
    from actors.sampling import Sampler, SamplingRow
    from actors.sampling_params import SamplingParams

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.9, 0.2]])
    rows = [SamplingRow(SamplingParams(temperature=1e-300), [1], [], None),
            SamplingRow(SamplingParams(temperature=1e-300, top_p=0.5), [1], [], None)]
    out = Sampler(vocab_size=4, eos_token_ids=[]).__call__(logits, rows)
    assert [r.token_id for r in out] == [1, 2]
