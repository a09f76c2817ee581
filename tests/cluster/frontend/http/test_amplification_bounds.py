"""Issue 52, findings 3 and 4 (HTTP side), against a live 1P+1D cluster behind the real ingress.

3. echo + logprobs + prompt_logprobs with many prompts and n turned a 175 KB request into a 266 MB response
   built on the event loop (every other stream stalled 46 s): the response's logprob entries are now bounded
   per request (a 400 naming the product, before anything is admitted), and a large body that is allowed is
   built and encoded on a worker thread, so an innocent stream keeps flowing.
4. allowed_token_ids had no cap: every list-valued sampling field now has one (a 400 naming the field and
   the cap), and no list may name more ids than the vocabulary holds, on every path into the engine.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import IngressSection
from cluster.frontend.http.protocol import ApiError, RequestCaps
from cluster.frontend.http.responses import check_logprob_entries
from cluster.frontend.http.server import make_server
from tests.helpers.cluster import wait_until_idle
from tests.helpers.http_server import MODEL, running

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = 2048  # the tiny model's
HANG_BOUND_S = 5.0  # an innocent stream's largest gap: the old code stalled it ~10 s on the allowed body below


def _prompts(count: int, tokens: int, first: list[int] | None = None) -> list[list[int]]:
    made = [[(7 * i + j) % 2000 + 10 for j in range(tokens)] for i in range(count)]
    return ([first] if first else []) + made


def _refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- finding 3: echo + logprobs amplification ----

def test_the_findings_request_scaled_to_the_tiny_model_is_refused_at_once(server):
    cluster, url = server
    body = {"model": MODEL, "prompt": _prompts(16, 1900), "max_tokens": 16, "n": 4, "echo": True, "logprobs": 20,
            "prompt_logprobs": 20}
    for stream in (False, True):
        message = _refused(httpx.post(url + CMPL, json={**body, "stream": stream}, timeout=60), "prompt_logprobs")
        assert message == (
            "this response would hold (60,800 prompt tokens scored (echo and prompt_logprobs) + 16 prompts x 16 "
            "max_tokens) x n 4 x (1 + 20 top logprobs) = 5,128,704 logprob entries; at most 1,000,000 per request "
            "(ingress.max_response_logprobs): ask for fewer prompts, tokens, n or top logprobs")
    wait_until_idle(cluster)  # nothing was admitted, nothing is held
    ok = httpx.post(url + CMPL, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "echo": True, "logprobs": 20},
                    timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["tokens"]) > 2


def test_the_default_bound_lets_ordinary_logprob_requests_through():
    limit = RequestCaps().max_response_logprobs
    assert IngressSection().max_response_logprobs == limit == 1_000_000
    # lm-eval's loglikelihood: 64 prompts of 4,000 tokens, echo + logprobs 1, max_tokens 0
    assert check_logprob_entries(limit, [4000] * 64, 1, 0, 1, None, echo_logprobs=True) == 512_000
    # vLLM-style: logprobs 5 and prompt_logprobs 5 on 4,000 prompt tokens and 4,000 generated, n 4
    assert check_logprob_entries(limit, [4000], 4, 4000, 5, 5, echo_logprobs=False) == 192_000
    # no logprobs asked: nothing is amplified, nothing counted
    assert check_logprob_entries(limit, [2000] * 64, 16, 30_000, None, None, echo_logprobs=False) == 0
    with pytest.raises(ApiError) as refused:  # the finding's own request, on a 2,000-token model
        check_logprob_entries(limit, [2000] * 16, 4, 16, 20, 20, echo_logprobs=True)
    assert refused.value.param == "prompt_logprobs" and "= 5,397,504 logprob entries" in refused.value.message


def test_the_configured_bound_holds_for_chat_and_streams(server):
    small = IngressSection(max_response_logprobs=5_000)
    with running(make_server(server[0], "127.0.0.1", 0, small)) as url:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 100, "n": 4,
                "logprobs": True, "top_logprobs": 20}
        for stream in (False, True):
            message = _refused(httpx.post(url + CHAT, json={**chat, "stream": stream}, timeout=60), "logprobs")
            assert "(1 prompts x 100 max_tokens) x n 4 x (1 + 20 top logprobs) = 8,400 logprob entries; " \
                   "at most 5,000 per request" in message
        fits = httpx.post(url + CHAT, json={**chat, "top_logprobs": 5}, timeout=60)  # 100 x 4 x 6 = 2,400
        assert fits.status_code == 200, fits.text[:300]
        assert [len(c["logprobs"]["content"]) for c in fits.json()["choices"]] == [100] * 4
        cmpl = {"model": MODEL, "prompt": _prompts(2, 300), "max_tokens": 1, "prompt_logprobs": 20}
        message = _refused(httpx.post(url + CMPL, json=cmpl, timeout=60), "prompt_logprobs")
        assert "(600 prompt tokens scored (prompt_logprobs)) x n 1 x (1 + 20 top logprobs) = 12,600" in message
    wait_until_idle(server[0])


def _largest_gap_beside(url: str, ask) -> tuple[float, int, object]:
    """`ask()`'s answer, with the largest gap between an innocent stream's lines while it ran."""
    gaps: list[float] = []
    stop, failures = threading.Event(), []

    def innocent() -> None:
        try:
            while not stop.is_set():
                last = time.perf_counter()
                with httpx.stream("POST", url + CMPL, timeout=120, json={
                        "model": MODEL, "prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": True,
                        "ignore_eos": True}) as r:
                    for _ in r.iter_lines():
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
        except Exception as exc:  # seen by the test, not lost in the thread
            failures.append(exc)

    thread = threading.Thread(target=innocent, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(gaps) < 20:
        assert time.monotonic() < deadline and not failures, f"the innocent stream never flowed: {failures}"
        time.sleep(0.05)
    try:
        answer = ask()
    finally:
        measured = list(gaps)
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive() and not failures, failures
    return max(measured), len(measured), answer


def test_a_large_streamed_echo_does_not_stall_another_stream(server):
    """A streamed echo sends each prompt's logprobs in its first chunk: here 32 chunks of 10.5k entries (1 MB
    of JSON each), built and encoded on a worker thread (the old code built them on the loop; chunks this
    size interleave with other streams either way, ~1 s gaps here: the unit test below pins the thread),
    and read back whole."""
    cluster, url = server
    body = {"model": MODEL, "prompt": _prompts(8, 500), "max_tokens": 4, "n": 4, "echo": True, "logprobs": 20,
            "temperature": 0, "stream": True}

    def ask() -> list[dict]:
        with httpx.stream("POST", url + CMPL, json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()[:300]
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    gap, lines, chunks = _largest_gap_beside(url, ask)
    print(f"\n{len(chunks)} chunks; innocent stream's largest gap {gap:.2f} s over {lines} lines")
    echoed = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              and len(c["choices"][0]["logprobs"]["tokens"]) == 500]
    assert sorted(choice["index"] for choice in echoed) == list(range(32))
    for choice in echoed:
        assert choice["logprobs"]["token_logprobs"][0] is None and len(choice["logprobs"]["top_logprobs"][1]) >= 20
    assert gap < HANG_BOUND_S  # a hang bound, not a timing claim
    wait_until_idle(cluster)


def test_a_large_allowed_body_does_not_stall_another_stream(server):
    """683k logprob entries (33 MB of JSON): the old code built them on the event loop, ~10 s in which an
    innocent stream got nothing. Built on a worker thread, that stream keeps flowing."""
    cluster, url = server
    short = list(range(100, 120))
    body = {"model": MODEL, "prompt": _prompts(8, 500, first=short), "max_tokens": 16, "n": 4, "echo": True,
            "logprobs": 20, "prompt_logprobs": 20, "temperature": 0}
    gap, lines, big = _largest_gap_beside(url, lambda: httpx.post(url + CMPL, json=body, timeout=300))
    print(f"\nbody {len(big.content) / 1e6:.1f} MB; innocent stream's largest gap {gap:.2f} s over {lines} lines")
    assert big.status_code == 200, big.text[:300]
    choices = big.json()["choices"]
    assert len(choices) == 9 * 4
    for choice in choices[4:]:  # every 500-token prompt: echoed and scored, then 16 tokens
        assert len(choice["logprobs"]["tokens"]) == 516 and len(choice["prompt_logprobs"]) == 500
        assert all(len(top) <= 21 for top in choice["logprobs"]["top_logprobs"][1:])
    # The body built off the loop reads as the same request's small one, built on it.
    alone = httpx.post(url + CMPL, json={**body, "prompt": [short], "n": 1}, timeout=60).json()["choices"][0]
    first = choices[0]
    assert first["text"] == alone["text"] and first["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert first["prompt_logprobs"][0] is None and first["prompt_logprobs"][1].keys() == alone["prompt_logprobs"][1].keys()
    assert gap < HANG_BOUND_S  # a hang bound, not a timing claim
    wait_until_idle(cluster)


# ---- finding 4: caps on list-valued sampling fields ----

@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("field, value, cap", [
    ("allowed_token_ids", [5] * 4097, "at most 4096 are allowed (ingress.max_allowed_token_ids)"),
    ("stop_token_ids", list(range(17)), "at most 16 are allowed (ingress.max_stop_strings)"),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}, "at most 1024 are allowed (ingress.max_logit_bias)"),
])
def test_every_list_valued_sampling_field_is_capped(server, path, field, value, cap):
    base = {"model": MODEL, "max_tokens": 2, field: value}
    base.update({"prompt": "hi"} if path == CMPL else {"messages": [{"role": "user", "content": "hi"}]})
    message = _refused(httpx.post(server[1] + path, json=base, timeout=60), field)
    assert message == f"{field} has {len(value)} entries; {cap}"


def test_token_id_lists_stay_within_the_vocabulary(server):
    cluster, url = server
    ask = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}
    longer = _refused(httpx.post(url + CMPL, json={**ask, "allowed_token_ids": list(range(VOCAB)) + [7]},
                                 timeout=60), "allowed_token_ids")
    assert "2049 token ids, more than the vocabulary's 2048" in longer
    outside = _refused(httpx.post(url + CMPL, json={**ask, "allowed_token_ids": [3, VOCAB]}, timeout=60),
                       "allowed_token_ids")
    assert "outside the vocabulary [0, 2048)" in outside
    whole = httpx.post(url + CMPL, json={**ask, "allowed_token_ids": list(range(VOCAB))}, timeout=60)
    assert whole.status_code == 200, whole.text[:300]
    only = httpx.post(url + CMPL, json={**ask, "allowed_token_ids": [42, 43], "logprobs": 1,
                                        "return_tokens_as_token_ids": True}, timeout=60)
    assert only.status_code == 200, only.text[:300]
    assert {t for t in only.json()["choices"][0]["logprobs"]["tokens"]} <= {"token_id:42", "token_id:43"}
    wait_until_idle(cluster)


def test_the_engine_bounds_token_id_lists_without_the_ingress():
    """The Python client reaches the engine without the ingress's caps: the vocabulary bounds every list."""
    for field, value in (("allowed_token_ids", tuple(range(VOCAB + 1))), ("stop_token_ids", (1,) * (VOCAB + 1))):
        with pytest.raises(ValueError, match=f"{field}: {VOCAB + 1} token ids, more than the vocabulary's {VOCAB}"):
            SamplingParams(**{field: value}).validate_token_ids(VOCAB)
    SamplingParams(allowed_token_ids=tuple(range(VOCAB))).validate_token_ids(VOCAB)


def test_a_large_chunk_is_built_and_encoded_off_the_event_loop():
    """What keeps a streamed echo of a 1M-entry prompt (~100 MB, seconds of encoding) off the loop: the chunk's
    builder runs on a worker thread past OFF_LOOP_ENTRIES, on the loop below it, and both read the same."""
    import asyncio

    from cluster.frontend.http.responses import OFF_LOOP_ENTRIES
    from cluster.frontend.http.streaming import encoded_event

    built_on: list[threading.Thread] = []

    def build() -> dict:
        built_on.append(threading.current_thread())
        return {"choices": [{"index": 0, "logprobs": {"token_logprobs": [None, -1.5]}}]}

    small = asyncio.run(encoded_event(build, OFF_LOOP_ENTRIES))
    large = asyncio.run(encoded_event(build, OFF_LOOP_ENTRIES + 1))
    assert built_on[0] is threading.main_thread() and built_on[1] is not threading.main_thread()
    assert large.startswith(b"data: ") and large.endswith(b"\n\n") and json.loads(large[6:]) == small
