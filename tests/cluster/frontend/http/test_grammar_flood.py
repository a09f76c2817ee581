"""Grammars too large to compile are refused by name before anything compiles, while other streams go on:
the issue's 50,000-entry guided_choice and 20,000-entry enum (which took 14-97 s to compile and stalled
every worker) are a 400 within a second, streams sent beside them finish with the engine's text, and
/ready answers 200 throughout."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from actors.protocol.sampling_params import SamplingParams

MODEL = "tiny-llama"
PROMPTS = [f"stream number {i} says" for i in range(10)]


def _flood(client: openai.OpenAI) -> list[tuple[str, float, dict]]:
    asks = [
        ("guided_choice", {"guided_choice": [f"c{i}" for i in range(50_000)]}),
        ("response_format", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": {"type": "object", "properties": {"x": {"enum": [f"v{i}" for i in range(20_000)]}}}}}}),
        ("guided_json", {"guided_json": {"type": "object", "properties": {"x": {"enum": list(range(6_000))}}}}),
    ]
    answers = []
    for param, body in asks:
        started = time.monotonic()
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
        answers.append((param, time.monotonic() - started, bad.value.body))
    return answers


def test_huge_grammars_are_refused_while_other_streams_finish(server, engine):
    _, base = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    tokenizer = engine.tokenizer
    expected = [tokenizer.decode(r.outputs[0].token_ids, skip_special_tokens=True) for r in engine.generate(
        [tokenizer.encode(p) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))]
    got: dict[int, str] = {}
    ready: list[int] = []
    stop = threading.Event()

    def stream(i: int) -> None:
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in chunks if c.choices)

    def probe() -> None:
        while not stop.is_set():
            ready.append(httpx.get(base + "/ready", timeout=30).status_code)
            time.sleep(0.2)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    prober = threading.Thread(target=probe)
    for t in [*threads, prober]:
        t.start()
    answers = _flood(client)
    for t in threads:
        t.join(timeout=120)
    stop.set()
    prober.join(timeout=60)
    for param, took_s, body in answers:
        assert body["param"] == param and "at most" in body["message"], body
        assert took_s < 5.0, (param, took_s)  # refused before compiling, not after
    assert [got.get(i) for i in range(len(PROMPTS))] == expected
    assert ready and set(ready) == {200}, ready
