"""The batched Sampler: draws, greedy, constraints and penalties, seeds, logprobs."""

import pytest
import torch
from scipy.stats import chisquare

from actors.engine.sampling import Sampler, SamplingRow, new_generator
from actors.engine.sampling_filters import min_p_filter, top_k_filter, top_p_filter, typical_filter
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.sampling import support

EOS = 0
NEG_INF = float("-inf")


def make_row(prompt=(5,), output=(), **params) -> SamplingRow:
    sp = SamplingParams(**params)
    generator = new_generator(sp.seed) if sp.seed is not None else None
    return SamplingRow(sp, list(prompt), list(output), generator)


def tokens(results) -> list[int]:
    return [r.token_id for r in results]


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
    from actors.engine.sampling import Sampler, SamplingRow
    from actors.protocol.sampling_params import SamplingParams

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.5, 0.1, 0.9, 0.2]])
    rows = [SamplingRow(SamplingParams(temperature=1e-300), [1], [], None),
            SamplingRow(SamplingParams(temperature=1e-300, top_p=0.5), [1], [], None)]
    out = Sampler(vocab_size=4, eos_token_ids=[]).__call__(logits, rows)
    assert [r.token_id for r in out] == [1, 2]
