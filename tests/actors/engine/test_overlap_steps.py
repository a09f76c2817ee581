"""Overlapped steps (in_flight.py) on the CPU: step N+1 is launched before step N's tokens are read back.
The outputs must be the synchronous engine's, token for token, one step later, whatever ends, aborts,
preempts, hands off or waits for its token meanwhile; the pools' invariants hold after every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.in_flight import overlap_wanted, runs_blind
from actors.engine.sequence import Sequence
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams

BLOCK = 8


def _engine(model_dir, overlap: bool, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    engine = Engine(EngineConfig(model=str(model_dir), block_size=BLOCK, overlap_steps=overlap, **kw))
    assert engine.overlap is overlap
    return engine


def _prompts(n: int, vocab: int, seed: int = 7, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, vocab, (3 + (i * 11) % 58,), generator=g).tolist() for i in range(n)]


def _greedy(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=6 + (i * 5) % 20, ignore_eos=True, **kw) for i in range(n)]


def _serve(engine: Engine, prompts, params) -> dict[str, list]:
    """Every request's outputs in order (token ids, logprobs, finish state), checking the engine's
    invariants after every step; at the end no block is held."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            seen[out.request_id].append((out.index, out.new_token_ids, out.new_logprobs, out.prompt_logprobs,
                                            out.finish_reason, out.stop_reason, out.num_cached_tokens))
        engine.check_integrity()
        steps += 1
        assert steps < 2000, "the engine never finished"
    assert not engine.has_unfinished() and engine.num_used_blocks == 0
    return seen


def _assert_same_outputs(got: dict[str, list], want: dict[str, list]) -> None:
    """Token ids, finish states and cache hits exactly; logprobs within float rounding: a request that
    waits a step runs in a batch of another size, and on some CPUs (seen on AMD EPYC) a matmul of
    another row count rounds its last bits differently."""
    (got_exact, got_floats), (want_exact, want_floats) = _exact_and_floats(got), _exact_and_floats(want)
    assert got_exact == want_exact
    torch.testing.assert_close(torch.tensor(got_floats, dtype=torch.float64),
                               torch.tensor(want_floats, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def _exact_and_floats(x) -> tuple[object, list[float]]:
    """(x with every float replaced by a marker, the floats in order)."""
    if isinstance(x, float):
        return "<float>", [x]
    if dataclasses.is_dataclass(x):
        x = (type(x).__name__, *(getattr(x, f.name) for f in dataclasses.fields(x)))
    elif isinstance(x, dict):
        x = sorted(x.items())
    if isinstance(x, (list, tuple)):
        parts = [_exact_and_floats(item) for item in x]
        return tuple(p[0] for p in parts), [f for p in parts for f in p[1]]
    return x, []


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked prefill beside decodes
        dict(max_num_seqs=5),  # sequences join and leave every step
        dict(num_kv_blocks=24),  # preemption: running sequences are recomputed
        dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
    ],
    ids=["batch16", "chunked16", "max-seqs-5", "preempting", "no-chunking"],
)
def test_overlapped_steps_give_the_synchronous_tokens(hf_models, settings):
    prompts, params = _prompts(16, 512), _greedy(16)
    sync = _serve(_engine(hf_models["llama"], False, **settings), prompts, params)
    overlapped = _engine(hf_models["llama"], True, **settings)
    _assert_same_outputs(_serve(overlapped, prompts, params), sync)
    if "num_kv_blocks" in settings:
        assert overlapped.batcher.num_preemptions > 0


def test_prefix_hits_and_sliding_windows_under_overlap(hf_models):
    prefix = _prompts(1, 300, seed=3)[0][:29]
    prompts, params = _prompts(12, 300, prefix=prefix), _greedy(12)
    for kind in ("llama", "mistral"):  # mistral: every layer windowed, so old blocks go back as it decodes
        sync, overlapped = _engine(hf_models[kind], False), _engine(hf_models[kind], True)
        for _ in range(2):  # the second time, the prompts' full blocks are cached
            _assert_same_outputs(_serve(overlapped, prompts, params), _serve(sync, prompts, params))


def test_every_kind_of_request_gives_the_synchronous_outputs(hf_models):
    """Sampling that reads past tokens (penalties, min_tokens), forks (n=2), seeded draws, logprobs, early
    stops and one-token requests, side by side: each waits or runs blind as it must."""
    prompts = _prompts(10, 512)  # greedy, r0, r6 and r9 repeat a token at once: the penalties change them
    probe = _serve(_engine(hf_models["llama"], False), prompts[1:2], _greedy(1))
    tokens = [out[1][0] for out in probe["r0"]]
    # A greedy token of r1 not seen before its fourth: r1 stops there, the others wherever it comes.
    at, stop = next((i, t) for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop]),
        SamplingParams(temperature=0.8, max_tokens=10, seed=5, top_p=0.9),
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=11, presence_penalty=0.7, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=7, seed=9, n=2),
        # r1's prompt again: the stop token is banned until the very token it comes as (a view one token
        # short, as a blind step would have, would still ban it there).
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=at, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=1, frequency_penalty=2.0, ignore_eos=True),
    ]
    prompts[8] = prompts[1]
    sync = _serve(_engine(hf_models["llama"], False), prompts, params)
    assert sync["r1"][-1][4] == sync["r8"][-1][4] == "stop" and len(sync["r1"]) == len(sync["r8"]) == at + 1
    _assert_same_outputs(_serve(_engine(hf_models["llama"], True), prompts, params), sync)


def test_tokens_arrive_one_step_later(hf_models):
    engine = _engine(hf_models["llama"], True)
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    per_call = []
    while engine.has_work():
        per_call.append([t for out in engine.step() for t in out.new_token_ids])
        engine.check_integrity()
    # The prefill's call returns nothing; each later call returns the token of the step before it. The
    # last token's length stop is known at launch: no step runs past it, so 4 tokens take 5 calls.
    assert [len(tokens) for tokens in per_call] == [0, 1, 1, 1, 1]
    sync = _engine(hf_models["llama"], False)
    assert [t for tokens in per_call for t in tokens] == sync.generate([[5, 6, 7]], SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids


def test_an_abort_while_its_step_is_in_flight_drops_the_token(hf_models):
    engine = _engine(hf_models["llama"], True)
    for rid in ("a", "b"):
        engine.add_request(rid, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    got = {"a": [], "b": []}
    for _ in range(4):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.abort("a")  # its next token is in flight
    engine.check_integrity()
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        engine.check_integrity()
    assert len(got["a"]) == 3 and len(got["b"]) == 20
    assert engine.num_used_blocks == 0


def test_a_handed_off_prompt_waits_for_its_first_token(hf_models):
    """A prefill that hands its KV off is parked once its first token is known; no step runs it blind."""
    prompt = _prompts(1, 512, seed=5)[0]
    sync = _engine(hf_models["llama"], False)
    sync.add_request("h", prompt, SamplingParams(temperature=0.0, max_tokens=8), hand_off=True)
    first = sync.step()[0]
    engine = _engine(hf_models["llama"], True)
    engine.add_request("h", prompt, SamplingParams(temperature=0.0, max_tokens=8), hand_off=True)
    engine.add_request("other", [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
        engine.check_integrity()
    handed = [out for out in outputs if out.request_id == "h"]
    assert [(o.new_token_ids, o.status) for o in handed] == [(first.new_token_ids, RequestStatus.TRANSFERRING)]
    assert engine.lease_blocks("h") == sync.lease_blocks("h")
    assert engine.release("h") and engine.num_used_blocks == 0


def test_a_failed_step_leaves_nothing_in_flight(hf_models, monkeypatch):
    engine = _engine(hf_models["llama"], True)
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    assert not engine.has_work() or engine._stepper.in_flight is None
    engine.check_integrity()  # no sequence counts a token that will never come
    assert engine.abort("r") and engine.num_used_blocks == 0


def _seq(**params) -> Sequence:
    seq = Sequence("r", 0, [1, 2, 3], SamplingParams(**{"max_tokens": 10, **params}))
    seq.output_token_ids, seq.num_pending = [4], 1
    return seq


def test_which_sequences_run_blind():
    assert runs_blind(_seq(), max_model_len=100)
    assert runs_blind(_seq(temperature=0.7, seed=1, logprobs=3, top_k=5), max_model_len=100)
    assert runs_blind(_seq(min_tokens=1), max_model_len=100)  # already met before the pending token
    assert not runs_blind(_seq(min_tokens=2), max_model_len=100)
    assert not runs_blind(_seq(repetition_penalty=1.2), max_model_len=100)
    assert not runs_blind(_seq(frequency_penalty=0.1), max_model_len=100)
    assert not runs_blind(_seq(presence_penalty=0.1), max_model_len=100)
    assert not runs_blind(_seq(max_tokens=2), max_model_len=100)  # the pending token is its last
    assert not runs_blind(_seq(), max_model_len=5)
    handing = _seq()
    handing.hand_off = True
    assert not runs_blind(handing, max_model_len=100)
    forking = dataclasses.replace(_seq(), pending_forks=1)
    assert not runs_blind(forking, max_model_len=100)


def test_overlap_is_chosen_for_cuda_and_never_across_ranks():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert overlap_wanted(None, cuda, 1) and not overlap_wanted(None, cpu, 1)
    assert overlap_wanted(True, cpu, 1) and not overlap_wanted(False, cuda, 1)
    assert not overlap_wanted(True, cuda, 2) and not overlap_wanted(None, cuda, 4)


def test_structured_output_waits_for_each_token(smollm2_dir):
    """A grammar's mask needs the token before it: such a sequence never runs blind, and its output is
    the synchronous engine's (SmolLM2, whose greedy JSON closes by itself)."""
    from actors.protocol.structured_output import StructuredOutput

    ask = [{"role": "user", "content": "Describe a cat as a JSON object with the keys name and age."}]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_output=StructuredOutput("json_object")),
              SamplingParams(temperature=0.0, max_tokens=12, structured_output=StructuredOutput("regex", "[a-z ]+")),
              SamplingParams(temperature=0.0, max_tokens=12)]
    results = []
    for overlap in (False, True):
        engine = Engine(EngineConfig(model=str(smollm2_dir), overlap_steps=overlap, kv_cache_memory_bytes=64 << 20))
        prompt = engine.tokenizer.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        results.append(_serve(engine, [ids] * 3, params))
    assert results[1] == results[0]
