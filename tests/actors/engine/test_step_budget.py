"""Steps that protect TPOT (`engine.step_budget_ms`): decodes first, and a step that carries decodes takes
only the prompt tokens its measured cost leaves within the budget, at least MIN_PREFILL_TOKENS; a step with
no decode takes the whole token budget. The batcher's choices are checked on a StepCost fed known costs
(no model, no timing); the engine test checks the greedy outputs do not change with the budget binding."""

from __future__ import annotations

import pytest

from actors.engine.batcher import MIN_PREFILL_TOKENS, Batcher
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.kv.cache_manager import KVCacheManager
from actors.engine.sequence import Sequence
from actors.engine.step_cost import StepCost
from actors.engine.step_shape import shape_of
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams

BLOCK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def _linear(cost: StepCost, fixed_s: float = 0.010, per_token_s: float = 0.001) -> StepCost:
    """A CPU-like curve: `fixed_s` + `per_token_s` a token, measured at steps of 1 to 1,024 tokens."""
    for tokens in (1, 8, 64, 512, 1024):
        cost.observe(tokens, fixed_s + per_token_s * tokens)
    return cost


def _batcher(budget_s: float | None = 0.0605, tokens: int = 512, **kw) -> Batcher:
    batcher = Batcher(KVCacheManager(1024, BLOCK), max_num_seqs=64, max_num_batched_tokens=tokens,
                      enable_chunked_prefill=True, step_budget_s=budget_s, **kw)
    _linear(batcher.cost)
    return batcher


def _decoding(batcher: Batcher, name: str, prompt_len: int = 40) -> Sequence:
    """A running sequence with one token sampled and its prompt's KV in place: its next step is a decode."""
    seq = Sequence(name, 0, list(range(1, prompt_len + 1)), PARAMS, output_token_ids=[7],
                   num_computed_tokens=prompt_len, status=RequestStatus.DECODING)
    assert batcher.kv.allocate_slots(seq.seq_id, prompt_len) is not None
    batcher.running.append(seq)
    return seq


def _prompt(batcher: Batcher, name: str, length: int) -> Sequence:
    seq = Sequence(name, 0, [(i % 500) + 1 for i in range(length)], PARAMS)
    batcher.add(seq)
    return seq


def _advance(batch) -> None:
    """What a step does to its sequences' counts: computed tokens advance, and one that reached its last
    token samples the next."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(7)


def _split(batch) -> tuple[list[int], int]:
    """(tokens of each decode in the batch, prompt tokens)."""
    shape = shape_of(batch.seqs, batch.num_new_tokens)
    decodes = [n for s, n in zip(batch.seqs, batch.num_new_tokens) if not Batcher._is_prompt_work(s)]
    assert len(decodes) == shape.decode_seqs
    return decodes, shape.prefill_tokens


def test_tokens_within_follows_the_measured_curve():
    cost = StepCost()
    assert cost.tokens_within(0.0605, 512) is None  # nothing measured
    cost.observe(1, 0.011)
    assert cost.tokens_within(0.0605, 512) is None  # one size of step: no slope yet
    _linear(cost)
    assert cost.tokens_within(0.0605, 512) == 50  # 10 ms + 1 ms a token
    assert cost.tokens_within(0.005, 512) == 0  # even one token takes longer
    assert cost.tokens_within(10.0, 512) == 512
    assert cost.max_tokens(2.05, 512) == 12  # the tenants' cap is the same search: 2.05 x 11 ms


def test_a_step_with_decodes_takes_the_prompt_tokens_the_budget_leaves():
    batcher = _batcher(budget_s=0.0605)
    decodes = [_decoding(batcher, f"d{i}") for i in range(8)]
    prompt = _prompt(batcher, "long", 1000)
    batch = batcher.schedule()
    assert batch.seqs[:8] == decodes and batch.num_new_tokens[:8] == [1] * 8
    assert batch.seqs[8:] == [prompt] and batch.num_new_tokens[8:] == [42]  # 50 tokens fit 60.5 ms, 8 are decodes
    assert batcher.cost.seconds(batch.total_tokens) <= 0.0605 < batcher.cost.seconds(batch.total_tokens + 1)
    assert batcher.budgeted_steps == 1
    batcher.check_integrity()


def test_decodes_go_first_even_behind_a_running_prefill():
    """A prompt admitted before the decodes and still mid-prefill does not take their budget: with 64
    tokens a step (and no time budget) the 8 decodes run and the prompt gets the other 56."""
    batcher = _batcher(budget_s=None, tokens=64)
    prompt = _prompt(batcher, "long", 1000)
    _advance(batcher.schedule())  # its first chunk: 64 tokens
    assert prompt.num_computed_tokens == 64 and batcher.running == [prompt]
    decodes = [_decoding(batcher, f"d{i}") for i in range(8)]
    batch = batcher.schedule()
    assert batch.seqs == decodes + [prompt] and batch.num_new_tokens == [1] * 8 + [56]


def test_a_step_without_decodes_takes_the_whole_token_budget():
    batcher = _batcher(budget_s=0.0605, tokens=512)
    prompt = _prompt(batcher, "long", 1000)
    batch = batcher.schedule()
    assert batch.seqs == [prompt] and batch.num_new_tokens == [512]  # 522 ms predicted: nobody waits on it
    assert batcher.budgeted_steps == 0


def test_nothing_measured_yet_means_the_token_budget():
    batcher = Batcher(KVCacheManager(1024, BLOCK), 64, 512, True, step_budget_s=0.0605)
    _decoding(batcher, "d0")
    _prompt(batcher, "long", 1000)
    assert batcher.schedule().num_new_tokens == [1, 511]


def test_a_prompt_progresses_by_the_minimum_when_decodes_alone_overrun_the_budget():
    """48 decodes take 58 ms, over a 20.5 ms budget: every step still computes MIN_PREFILL_TOKENS of the
    prompt beside all of them, until the prompt is done and decodes too."""
    batcher = _batcher(budget_s=0.0205)
    decodes = [_decoding(batcher, f"d{i}") for i in range(48)]
    prompt = _prompt(batcher, "long", 100)
    chunks = []
    while prompt.num_computed_tokens < len(prompt.prompt_token_ids):
        batch = batcher.schedule()
        decode_tokens, prompt_tokens = _split(batch)
        assert decode_tokens == [1] * 48 and batch.seqs[:48] == decodes  # no decode is ever dropped
        chunks.append(prompt_tokens)
        _advance(batch)
    assert MIN_PREFILL_TOKENS == 32
    assert chunks == [32, 32, 32, 4]
    decode_tokens, prompt_tokens = _split(batcher.schedule())
    assert decode_tokens == [1] * 49 and prompt_tokens == 0  # the prompt sampled its first token: a decode now
    batcher.check_integrity()


def test_the_decode_worker_prompt_cap_and_the_budget_both_hold():
    """`max_prefill_tokens` (a decode worker's local prefill) and the budget: the smaller one cuts."""
    tight = _batcher(budget_s=0.0605)  # the budget leaves 42 beside 8 decodes
    tight.max_prefill_tokens = 100
    loose = _batcher(budget_s=0.0605)
    loose.max_prefill_tokens = 20
    for batcher, expected in ((tight, 42), (loose, 20)):
        for i in range(8):
            _decoding(batcher, f"d{i}")
        _prompt(batcher, "long", 1000)
        assert _split(batcher.schedule()) == ([1] * 8, expected)
    alone = _batcher(budget_s=0.0605)
    alone.max_prefill_tokens = 100
    _prompt(alone, "long", 1000)
    assert _split(alone.schedule()) == ([], 100)  # no decode: the cap alone


def test_adopted_requests_waiting_count_as_decodes_and_go_first():
    """On a decode worker an adopted request waits with its prompt's KV in place: it is admitted before a
    prompt queued ahead of it, and the budget leaves room for it."""
    batcher = _batcher(budget_s=0.0605)
    prompt = _prompt(batcher, "long", 1000)
    adopted = Sequence("adopted", 0, list(range(1, 41)), PARAMS, output_token_ids=[7], num_computed_tokens=40)
    assert batcher.kv.allocate_slots(adopted.seq_id, 40) is not None
    batcher.add(adopted)
    batch = batcher.schedule()
    assert batch.seqs == [adopted, prompt] and batch.num_new_tokens == [1, 49]


def test_the_setting_has_one_default_and_reaches_the_batcher(hf_models):
    from cluster.control.config import EngineSection, TandemConfig

    with pytest.raises(ValueError, match="step_budget_ms"):
        EngineConfig(model=str(hf_models["llama"]), step_budget_ms=0)
    assert EngineConfig(model=str(hf_models["llama"])).step_budget_ms is None  # off unless asked for (measured)
    assert EngineSection().step_budget_ms is None
    assert Engine(EngineConfig(model=str(hf_models["llama"]))).batcher.step_budget_s is None
    config = TandemConfig.model_validate({"model": {"path": str(hf_models["llama"])}, "engine": {"step_budget_ms": 40}})
    engine = Engine(config.engine_config())
    assert engine.batcher.step_budget_s == 0.040
    off = TandemConfig.model_validate({"model": {"path": str(hf_models["llama"])}, "engine": {"step_budget_ms": None}})
    assert Engine(off.engine_config()).batcher.step_budget_s is None


def test_greedy_outputs_are_unchanged_with_the_budget_binding(hf_models):
    """A budget no step meets (1 us): once two sizes of step are measured, every step with decodes computes
    at most MIN_PREFILL_TOKENS of prompts, and the greedy outputs are the ones without a budget."""
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(20 + 23 * i)] for i in range(6)]  # 20..135 tokens
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    def run(step_budget_ms):
        engine = Engine(EngineConfig(model=str(hf_models["llama"]), block_size=8, num_kv_blocks=256,
                                     max_num_batched_tokens=128, step_budget_ms=step_budget_ms))
        ids = {i: [] for i in range(len(prompts))}
        shapes = []
        engine.add_request(0, prompts[0], params)
        steps = 0
        while engine.has_unfinished():
            if steps == 2:  # two sizes of step measured: a 20-token prompt, then one decode
                for i, prompt in enumerate(prompts[1:], 1):
                    engine.add_request(i, prompt, params)
            steps += 1
            for out in engine.step():
                ids[out.request_id] += out.new_token_ids
            shapes.append(engine.last_step_shape)
        engine.check_integrity()
        assert engine.num_used_blocks == 0
        return ids, shapes, engine.batcher.budgeted_steps

    unbudgeted, free_shapes, _ = run(None)
    budgeted, shapes, cut = run(0.001)
    assert budgeted == unbudgeted
    assert cut > 0
    assert max(s.prefill_tokens for s in shapes if s.decode_seqs) == MIN_PREFILL_TOKENS
    assert max(s.prefill_tokens for s in free_shapes if s.decode_seqs) > MIN_PREFILL_TOKENS  # it did cut
