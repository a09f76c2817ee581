"""The OpenAI HTTP ingress driven by the official `openai` client against a live 1P+1D cluster."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import wait_until_idle
from tests.helpers.http_server import MODEL

WAIT_S = 60.0


def idle(server):
    state = wait_until_idle(server[0])
    for stats in state["workers"].values():
        assert stats["used_blocks"] == 0 and stats["reserved"] == 0 and stats["held"] == 0, stats
    assert state["scheduler"]["in_flight"] == 0


def test_completion_greedy_matches_the_engine(server, client, engine):
    prompt = "The quick brown fox"
    (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    idle(server)


def test_chat_streaming_and_not_match_the_engine(server, client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    (ref,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})
    chunks = list(streamed)
    # The role comes with the first token, as vLLM sends it: a client timing TTFT from the first chunk
    # sees queueing and prefill.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    idle(server)


def test_n2_stop_and_logprobs(server, client, engine):
    out = client.completions.create(model=MODEL, prompt="Two samples", max_tokens=6, n=2, temperature=1.0, seed=3,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12

    (ref,) = engine.generate(["Stop here"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    full = ref.outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"

    lp = client.completions.create(model=MODEL, prompt="Log probs", max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True})
    info = lp.choices[0].logprobs
    assert len(info.token_logprobs) == 4 and all(len(t) == 2 for t in info.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(info.top_logprobs, info.token_logprobs))  # greedy
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)
    idle(server)


def test_error_paths(server, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", top_p=0)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="word " * 3000)
    assert bad.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", n=99)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as missing:  # 404, as OpenAI and vLLM answer
        client.completions.create(model="gpt-17", prompt="x")
    assert missing.value.body["param"] == "model" and missing.value.status_code == 404
    too_big = httpx.post(server[1] + "/v1/completions", content=b"x" * (2 << 20),
                         headers={"content-type": "application/json"})
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == 413
    # More KV than any decode worker holds: a client error, not a retry.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2000, n=16)
    idle(server)


def test_overload_is_429_with_retry_after(server, client):
    # One request holds most of the decode worker's KV (reserved for prompt + max_tokens x n)...
    hog = client.completions.create(model=MODEL, prompt="hog", max_tokens=1900, n=4, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    next(iter(hog))
    # ...so the next big one waits for room, then is turned away after the queue timeout (1 s here).
    raw = httpx.post(server[1] + "/v1/completions", timeout=30,
                     json={"model": MODEL, "prompt": "late", "max_tokens": 1900, "n": 4})
    assert raw.status_code == 429, raw.text
    assert int(raw.headers["retry-after"]) >= 1
    hog.close()
    idle(server)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    """The client goes away after the first chunk: the request is cancelled in the cluster (not run to its
    1500 tokens) and every block is freed. (How soon after the disconnect is a timing, not asserted.)"""
    before = wait_until_idle(server[0])["scheduler"]["counters"]
    with httpx.stream("POST", server[1] + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "long", "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    state = wait_until_idle(server[0])
    assert state["scheduler"]["in_flight"] == 0, state["scheduler"]
    assert all(s["used_blocks"] == 0 and s["live_requests"] == 0 for s in state["workers"].values())
    counters = state["scheduler"]["counters"]
    assert (counters["cancelled"], counters["finished"]) == (before["cancelled"] + 1, before["finished"]), counters


def test_models_health_ready_and_metrics(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(server[1] + "/health").json() == {"status": "ok"}
    assert httpx.get(server[1] + "/ready").status_code == 200
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server[1] + "/metrics").text)}
    ttft = families["tandem:time_to_first_token_seconds"]
    count = [s.value for s in ttft.samples if s.name.endswith("_count")][0]
    assert count > 0
    # Labelled with the pool that computed the first token (1P+1D: prefill, or decode for a prompt it prefilled)
    assert {s.labels["pool"] for s in ttft.samples if s.name.endswith("_count")} <= {"prefill", "decode"}
    kv = {s.labels["worker"]: s.labels["pool"] for s in families["tandem:worker_kv_usage"].samples}
    assert kv == {"prefill-0": "prefill", "decode-0": "decode"}, kv
    assert "tandem:pool_kv_usage" in families and "tandem:requests_finished" in families
    for phase in ("queue_time", "prefill_time", "kv_transfer_time", "decode_time"):
        samples = families[f"tandem:request_{phase}_seconds"].samples
        assert [s.value for s in samples if s.name.endswith("_count")][0] > 0, phase
    assert [s.value for s in families["tandem:kv_transfer_bytes"].samples][0] > 0
    links = families["tandem:kv_link_latency_seconds"].samples  # the scheduler's measured handoff cost
    assert links and all(s.labels["link"].startswith("prefill-") and s.value >= 0 for s in links), links
    queries = [s.value for s in families["tandem:prefix_cache_queries"].samples if s.name.endswith("_total")][0]
    assert queries > 0


def test_slow_client_is_bounded_then_aborted(server):
    """A reader that stalls never makes the server buffer more than the per-request bound."""
    import asyncio

    from cluster.frontend.http.gate import Gate
    from cluster.frontend.http.ingress import Ingress
    from cluster.frontend.http.served_model import ServedModel

    cluster = server[0]
    client = open_client(cluster)
    ingress = Ingress(client, ServedModel(MODEL, client.tokenizer, 2048, 2048), Gate(None), queue_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    before = wait_until_idle(cluster)["scheduler"]["counters"]

    def steps() -> int:  # the decode worker's steps so far: one token of the stalled request each
        return ray.get(cluster.workers["decode-0"].step_log.remote(0), timeout=30)[0]

    async def stalled_reader():
        loop, deadline = asyncio.get_running_loop(), time.monotonic() + WAIT_S
        (stream,) = await ingress.open_all([[11] * 8], params, None)
        while not stream.inbox.overflowed:  # the client reads nothing while the cluster generates
            assert time.monotonic() < deadline, "the cluster never filled the stalled reader's queue"
            await asyncio.sleep(0.01)
        # The cluster goes on generating (nothing has read the overflow yet): 20 more tokens come, none kept.
        more = await loop.run_in_executor(None, steps) + 20
        while await loop.run_in_executor(None, steps) < more:
            assert time.monotonic() < deadline, "the decode worker stopped stepping the stalled request"
        held = stream.inbox.qsize()
        events = [ev async for ev in ingress.events(stream, time.perf_counter())]
        return held, stream.inbox.overflowed, events

    held, overflowed, events = asyncio.run(stalled_reader())
    assert overflowed and held <= 4 and events == []
    rejected = [s.value for m in text_string_to_metric_families(ingress.metrics.render().decode())
                for s in m.samples if s.name == "tandem:requests_rejected_total" and s.labels["reason"] == "slow_client"]
    assert rejected == [1.0]
    counters = wait_until_idle(cluster)["scheduler"]["counters"]  # then aborted in the cluster, not run to its end
    assert (counters["cancelled"], counters["finished"]) == (before["cancelled"] + 1, before["finished"]), counters


def test_prompt_forms_and_echo(server, client, engine):
    ids = engine.tokenizer.encode("Token ids in")
    (ref,) = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True})
    prompt_text = engine.tokenizer.decode(ids, skip_special_tokens=True)
    assert by_ids.choices[0].text == prompt_text + ref.outputs[0].text
    several = client.completions.create(model=MODEL, prompt=["first prompt", "second one"], max_tokens=3, n=2,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in several.choices) == [0, 1, 2, 3]
    assert several.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in several.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: both samples agree
    idle(server)


def test_request_deadline_times_out_and_frees_blocks(server, client):
    cancelled = server[0].check_integrity()["scheduler"]["counters"]["cancelled"]
    with pytest.raises(openai.APIStatusError) as err:  # the server gave up: an error status, not a 200
        client.completions.create(model=MODEL, prompt="deadline", max_tokens=1500, temperature=0,
                                  extra_body={"ignore_eos": True, "timeout": 0.3})
    assert err.value.status_code == 408 and err.value.body["type"] == "timeout"  # its own timeout: 408
    assert "deadline" in err.value.body["message"]
    chunks = list(client.completions.create(model=MODEL, prompt="deadline", max_tokens=1500, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, "timeout": 0.3}))
    assert chunks[-1].choices[0].finish_reason == "error"
    idle(server)
    # Aborted in the cluster at its deadline, not left to generate its 1500 tokens for nobody.
    assert server[0].check_integrity()["scheduler"]["counters"]["cancelled"] == cancelled + 2
