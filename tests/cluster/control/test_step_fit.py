"""The cost model fitted on a worker's step log: a log drawn from a known linear cost gives that cost back,
grouped by shape so that thousands of one shape and a stalled step do not move it; a mixed step is left out;
a log without one kind of step is refused by name. And the engine's step shape: what a batch computes."""

from __future__ import annotations

import random

import pytest

from actors.engine.step_shape import StepShape, shape_of
from actors.engine.sequence import Sequence
from actors.protocol.sampling_params import SamplingParams
from actors.worker.step_log import StepLog, StepRecord
from cluster.control.autoscale.fit import fit_worker_steps
from cluster.control.autoscale.profile import BatchShape, LinearCost

TRUE = LinearCost(prefill_base_s=0.010, prefill_per_token_s=0.002, prefill_per_pair_s=1e-7,
                  decode_base_s=0.040, decode_per_seq_s=0.003, decode_per_context_token_s=2e-6)


def _step(shape: StepShape, period: float) -> StepRecord:
    return StepRecord(*shape, period * 0.6, period)


def _true_s(shape: StepShape) -> float:
    return TRUE.step_s(BatchShape(*shape), None)


def _log(rng: random.Random) -> list[dict]:
    steps = []
    for _ in range(3000):  # one common shape, many times
        shape = StepShape(decode_seqs=1, decode_context=300)
        steps.append(_step(shape, _true_s(shape)))
    for b in (2, 4, 8, 16, 32):
        for c in (100, 600, 1500):
            shape = StepShape(decode_seqs=b, decode_context=b * c)
            steps.append(_step(shape, _true_s(shape) * rng.uniform(0.98, 1.02)))
    for n in (16, 64, 256, 512):
        for done in (0, 512, 1024):
            shape = StepShape(n, n * done + n * (n + 1) // 2, 1)
            steps.append(_step(shape, _true_s(shape) * rng.uniform(0.98, 1.02)))
    steps.append(_step(StepShape(decode_seqs=4, decode_context=1200), 5.0))  # a step the machine stalled
    steps.append(_step(StepShape(512, 200_000, 1, 8, 4000), 0.001))  # mixed: not fitted
    return steps


def test_a_log_from_a_known_cost_gives_it_back():
    cost, used = fit_worker_steps(_log(random.Random(0)))
    assert used["mixed_steps"] == 1 and used["prefill_steps"] == 12 and used["decode_steps"] == 3016
    for name in ("prefill_base_s", "prefill_per_token_s", "decode_base_s", "decode_per_seq_s"):
        assert getattr(cost, name) == pytest.approx(getattr(TRUE, name), rel=0.15), name
    for shape in (StepShape(decode_seqs=8, decode_context=8 * 800), StepShape(300, 300 * 700 + 300 * 301 // 2, 1)):
        assert cost.step_s(BatchShape(*shape), None) == pytest.approx(_true_s(shape), rel=0.03)


def test_a_log_without_prefill_steps_is_refused_by_name():
    only_decodes = [s for s in _log(random.Random(1)) if not s.prefill_tokens]
    with pytest.raises(ValueError, match="prefill-only steps"):
        fit_worker_steps(only_decodes)


def test_the_period_runs_to_the_next_step_or_to_the_wait():
    log = StepLog(keep=2)
    log.started(10.0)
    log.ran(StepShape(decode_seqs=1, decode_context=5), 10.0, 0.03)
    log.started(10.05)  # the next step: the first one's period is 50 ms
    log.ran(StepShape(decode_seqs=1, decode_context=6), 10.05, 0.03)
    log.idle(10.09)  # no more work: the second one's period ends when the thread waits
    log.idle(11.0)  # nothing open: nothing logged
    log.started(12.0)
    log.ran(StepShape(8, 36, 1), 12.0, 0.02)
    log.started(12.01)  # (its period can't be shorter than the step itself)
    total, steps = log.records()
    assert total == 3 and len(steps) == 2  # the oldest went
    assert steps[0][-1] == pytest.approx(0.04) and steps[1][-2:] == (0.02, 0.02)


def test_a_batch_shape_separates_prompt_chunks_from_decodes():
    params = SamplingParams(max_tokens=8)
    chunk = Sequence("a", 0, list(range(1000)), params, num_computed_tokens=512)  # its second chunk
    whole = Sequence("b", 0, list(range(20)), params)
    decoding = Sequence("c", 0, list(range(30)), params, output_token_ids=[1, 2], num_computed_tokens=31)
    shape = shape_of([chunk, whole, decoding], [488, 20, 1])
    assert shape == StepShape(prefill_tokens=508, prefill_pairs=488 * 512 + 488 * 489 // 2 + 20 * 21 // 2,
                              prefill_samples=2, decode_seqs=1, decode_context=32)
    first_chunk = shape_of([Sequence("d", 0, list(range(1000)), params)], [512])
    assert first_chunk.prefill_samples == 0 and first_chunk.decode_seqs == 0
