"""Engine requests: abort, bad input, n > 1, stop conditions, seeds, KV events (acceptance 3, 5, 6)."""

from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.protocol.kv_events import BlockStored
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def engine(default_model_dir) -> Engine:
    return Engine(EngineConfig(model=str(default_model_dir), block_size=4, num_kv_blocks=128))


def _drain(engine: Engine) -> dict[tuple[str, int], list]:
    outs: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).append(o)
    engine.check_integrity()
    return outs


def test_abort_anywhere_frees_blocks_and_is_idempotent(engine):
    for rid in ("a", "b", "c"):
        engine.add_request(rid, "Hello world, this is a test of aborting", GREEDY)
    engine.step()
    engine.step()
    used_before = engine.num_used_blocks
    assert engine.abort("b") is True  # decoding
    assert engine.abort("b") is False
    assert engine.abort("never-added") is False
    assert engine.num_used_blocks < used_before
    engine.add_request("d", "queued then aborted", GREEDY)
    assert engine.abort("d") is True  # still waiting
    engine.check_integrity()
    outs = _drain(engine)
    assert set(outs) == {("a", 0), ("c", 0)}
    assert engine.num_used_blocks == 0


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", GREEDY, "prompt is empty"),
        ([], GREEDY, "prompt is empty"),
        ([5, 99999], GREEDY, "outside the vocabulary"),
        ([7] * 2048, GREEDY, "max_model_len"),
        ("hi", SamplingParams(stop_token_ids=(5000,)), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={-1: 2.0}), "logit_bias"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(engine, prompt, params, message):
    engine.add_request("good", "The engine keeps serving", GREEDY)
    first = engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    engine.check_integrity()
    outs = _drain(engine)
    assert set(outs) == {("good", 0)}
    assert outs[("good", 0)][-1].status == RequestStatus.FINISHED_LENGTH
    assert len(first) + sum(len(o.new_token_ids) for o in outs[("good", 0)]) == 24
    assert engine.num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n="),
        (dict(min_p=2.0), "min_p"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("x", "one", GREEDY)
    with pytest.raises(ValueError, match="already"):
        engine.add_request("x", "two", GREEDY)
    _drain(engine)


def test_n_samples_share_prompt_blocks(engine):
    prompt = "Shared prompt blocks for three samples, please"  # more than 4 full blocks of 4
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine.add_request("multi", prompt, params)
    first = engine.step()  # the whole prompt is computed, then forked into 3 samples
    assert sorted(o.index for o in first) == [0, 1, 2]
    tables = [engine.kv.block_table(("multi", i)) for i in range(3)]
    n_prompt = len(engine.tokenizer.encode(prompt))
    full = n_prompt // 4
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    for block in tables[0][:full]:
        assert engine.kv.pool.ref_count(block) == 3
    if n_prompt % 4:  # the partial last block is copied, never shared: each sample writes into it
        assert len({t[full] for t in tables}) == 3
    outs = _drain(engine)
    samples = {i: [t for o in [first[i], *outs[("multi", i)]] for t in o.new_token_ids] for i in range(3)}
    assert all(len(s) == 8 for s in samples.values())
    assert len({tuple(s) for s in samples.values()}) > 1
    # Sample i of a seeded request is reproducible alone: it draws from seed + i.
    for i in range(3):
        (alone,) = engine.generate([prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=8, ignore_eos=True))
        assert alone.outputs[0].token_ids == samples[i]
    assert engine.num_used_blocks == 0


def test_seeded_request_is_independent_of_the_batch(engine):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = engine.generate(["seeded prompt"], seeded)
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = engine.generate(["noise one", "seeded prompt", "another noisy one"], [noise, seeded, noise])
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert engine.num_used_blocks == 0


def test_stop_string_across_three_tokens(engine):
    (free,) = engine.generate(["Stop strings"], GREEDY)
    ids, text = free.outputs[0].token_ids, free.outputs[0].text
    tok = engine.tokenizer
    # A stop string made of the tail of token 5, all of token 6 and the head of token 7.
    pieces = [tok.decode([t]) for t in ids[5:8]]
    assert all(pieces), pieces
    stop = pieces[0][-1:] + pieces[1] + pieces[2][:1]
    start = text.index(stop)
    engine.add_request("s", "Stop strings", SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,)))
    outs = _drain(engine)[("s", 0)]
    chunks = [o.new_text for o in outs]
    assert "".join(chunks) == text[:start]
    assert outs[-1].status == RequestStatus.FINISHED_STOPPED and outs[-1].stop_reason == stop
    assert outs[-1].finish_reason == "stop"
    # No chunk ever ended in a partial stop string that was later withdrawn: the text is a prefix.
    emitted = ""
    for c in chunks:
        emitted += c
        assert text.startswith(emitted)
    assert engine.num_used_blocks == 0


def test_without_a_stop_match_all_text_comes_out(engine):
    (free,) = engine.generate(["Stop strings"], GREEDY)
    (stopped,) = engine.generate(["Stop strings"], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=("\x00never",)))
    assert stopped.outputs[0].text == free.outputs[0].text == engine.tokenizer.decode(free.outputs[0].token_ids, skip_special_tokens=True)
    assert stopped.outputs[0].finish_reason == "length"


def test_stop_token_ids_eos_and_min_tokens(engine):
    (free,) = engine.generate(["tokens"], GREEDY)
    ids = free.outputs[0].token_ids
    target = ids[4]
    first = ids.index(target)
    (stopped,) = engine.generate(["tokens"], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(target,)))
    assert stopped.outputs[0].token_ids == ids[: first + 1]
    assert stopped.outputs[0].stop_reason == target
    # min_tokens bans the stop token until reached, so the output runs past it.
    (late,) = engine.generate(["tokens"], SamplingParams(temperature=0.0, max_tokens=24, min_tokens=first + 2, stop_token_ids=(target,)))
    assert target not in late.outputs[0].token_ids[: first + 2]
    assert len(late.outputs[0].token_ids) >= first + 2


def test_kv_events_report_stored_prompt_blocks(engine):
    engine.take_kv_events()
    engine.generate([list(range(10, 30))], SamplingParams(temperature=0.0, max_tokens=1))
    stored = [e for e in engine.take_kv_events() if isinstance(e, BlockStored)]
    assert len(stored) == 5  # 20 prompt tokens = 5 full blocks of 4 (the sampled token fills none)
    parents = [e.parent_hash for e in stored]
    assert parents[0] is None and parents[1:] == [e.block_hash for e in stored[:-1]]


def test_generate_with_one_bad_prompt_leaves_nothing_behind(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate(["fine", "also fine", ""], GREEDY)
    assert not engine.has_unfinished()
    engine.check_integrity()
    assert engine.num_used_blocks == 0


def test_unsatisfiable_constraints_are_rejected(engine):
    eos = min(engine.eos_token_ids)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        engine.add_request("x", "hi", SamplingParams(allowed_token_ids=(eos,), min_tokens=2))
    assert not engine.has_unfinished()
