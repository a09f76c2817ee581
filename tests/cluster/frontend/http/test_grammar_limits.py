"""Structured-output specs that would cost everyone are refused by name, and what gets through is bounded
(issue 52, findings 1 and 2): the issue's 480-byte schema of 8 strings with maxLength 10^6 (12.4 s of
compile, then a minute of "did not compile" for everyone) is a 400 naming maxLength and the cap, and a
trivial guided_regex compiles right after; regex and pattern {m,n} and minItems likewise; the issue's
ambiguous grammar is a 400 naming its rule; an ambiguity the compile-time test misses ends with an error
naming the grammar once its matcher time passes the engine's budget, while a greedy stream beside it gets the
engine's own tokens. Compiles in flight are counted per tenant (a tenant's compiles past their budget hold its
slots, not another's), and the compile cache is bounded in bytes, least recently used out first."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import openai
import pytest

from actors.engine import structured
from actors.engine.structured import Grammars
from actors.engine.text.tokenizer import load_tokenizer
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.structured_output import MAX_REPEAT, MAX_REPEAT_TOTAL, StructuredOutput
from cluster.frontend.http.compile_slots import CompileSlots, CompileSlotsBusy

MODEL = "tiny-llama"
HUGE_STRINGS = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 1_000_000} for i in range(8)}}
HIDDEN_AMBIGUITY = 'root ::= s\ns ::= n s s | "a"\nn ::= ""'


def _refused(client: openai.OpenAI, body: dict) -> dict:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    return bad.value.body


def test_schema_bounds_past_the_cap_are_refused_by_keyword_and_a_trivial_regex_compiles_after(client):
    assert len(json.dumps(HUGE_STRINGS)) < 600
    started = time.monotonic()
    body = _refused(client, {"guided_json": HUGE_STRINGS})
    assert body["param"] == "guided_json"
    assert body["message"] == f"guided_json: the json_schema's maxLength is 1000000; at most {MAX_REPEAT} is compiled"
    print(f"refused in {time.monotonic() - started:.2f} s")
    many = {"type": "object", "properties": {f"p{i}": {"type": "array", "minItems": 900} for i in range(8)}}
    assert _refused(client, {"guided_json": many})["message"] == (
        f"guided_json: the json_schema's repetition bounds (minItems) add up to 7200; at most {MAX_REPEAT_TOTAL} are compiled")
    assert _refused(client, {"guided_regex": "[ab]{3,5000}"})["message"] == (
        f"guided_regex: the regex's {{m,n}} is 5000; at most {MAX_REPEAT} is compiled")
    pattern = {"type": "string", "pattern": "^x{2000}$"}
    assert "pattern {m,n} is 2000" in _refused(client, {"guided_json": pattern})["message"]
    started = time.monotonic()
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                    extra_body={"guided_regex": "(yes|no)[0-9]{1,3}"})
    print(f"trivial guided_regex answered in {time.monotonic() - started:.2f} s")
    assert out.choices[0].text[:2] in ("ye", "no"), out.choices[0].text


def test_the_issues_ambiguous_grammar_is_a_400_naming_its_rule(client):
    body = _refused(client, {"guided_grammar": 'root ::= s\ns ::= s s | "a"', "n": 12})
    assert body["param"] == "guided_grammar"
    assert body["message"].startswith("guided_grammar: the grammar is ambiguous: rule 's' is both left- and "
                                      "right-recursive"), body


def test_a_grammar_past_its_budget_ends_with_an_error_naming_it_while_a_greedy_stream_is_unchanged(client, engine):
    prompt = "an innocent stream"
    expected = engine.tokenizer.decode(engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(
        temperature=0.0, max_tokens=60, ignore_eos=True))[0].outputs[0].token_ids, skip_special_tokens=True)
    got: dict[str, str] = {}

    def innocent() -> None:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        got["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    thread = threading.Thread(target=innocent)
    thread.start()
    with pytest.raises(openai.BadRequestError) as failed:  # its own grammar ended it: the client's error
        out = client.completions.create(model=MODEL, prompt="x", max_tokens=600, n=4, temperature=0, timeout=120,
                                        extra_body={"guided_grammar": HIDDEN_AMBIGUITY, "min_tokens": 600})
        print([(c.finish_reason, len(c.text)) for c in out.choices])  # old code: 200, 4 x 600 "a"s
    thread.join(timeout=120)
    assert not thread.is_alive(), "the innocent stream never finished"
    message = failed.value.body["message"]
    assert message.startswith(f"the grammar {HIDDEN_AMBIGUITY!r} took "), message
    assert "past its budget of 1 ms per token (engine.grammar_ms_per_token)" in message, message
    assert got["text"] == expected


def test_a_tenants_compiles_past_their_budget_hold_its_slots_only():
    release = threading.Event()

    async def scenario():
        slots = CompileSlots(max_compiles=4, max_tenant_compiles=2)
        for _ in range(2):  # tenant a: two compiles that outlive their 0.2 s budget
            with pytest.raises(asyncio.TimeoutError):
                await slots.run("a", lambda: release.wait(30), 0.2)
        assert slots.of("a") == 2
        slots.check_integrity()
        with pytest.raises(CompileSlotsBusy, match="2 structured-output compiles of this tenant are still running"):
            await slots.run("a", lambda: "never", 0.2)
        started = time.monotonic()
        assert await slots.run("b", lambda: "compiled", 5.0) == "compiled"  # another tenant: at once
        waited_s = time.monotonic() - started
        release.set()
        deadline = time.monotonic() + 10
        while slots.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert slots.in_flight == 0 and dict(slots.started) == {"a": 2, "b": 1}
        return waited_s

    try:
        print(f"tenant b's compile waited {asyncio.run(scenario()):.3f} s")
    finally:
        release.set()


def test_the_compile_cache_is_bounded_in_bytes_least_recently_used_first(default_model_dir, monkeypatch):
    tokenizer = load_tokenizer(default_model_dir)
    grammars = Grammars(tokenizer, len(tokenizer))
    specs = [StructuredOutput("regex", f"(a|b){{1,20}}{end}") for end in "cdef"]  # alike, so alike in size
    sizes = [grammars.compile(s).memory_size_bytes for s in specs[:2]]
    assert grammars.cached == (2, sum(sizes)) and sum(sizes) < structured.CACHE_BYTES  # as shipped: both kept
    assert sizes[0] == sizes[1]
    monkeypatch.setattr(structured, "CACHE_BYTES", sum(sizes) + 1)  # room for two
    grammars.compile(specs[0])  # used again: now the most recent
    grammars.compile(specs[2])
    assert grammars.ready(specs[0]) and grammars.ready(specs[2]) and not grammars.ready(specs[1])
    count, size = grammars.cached
    assert count == 2 and size <= structured.CACHE_BYTES
    grammars.check_integrity()
