"""Bad input, one row per kind: the status, the OpenAI error envelope naming the parameter, and a
server that is healthy afterwards with no KV block held. Bodies are raw bytes, as an attacker (or a
buggy client) sends them: JSON's Infinity, lone surrogates, invalid UTF-8, absurd nesting."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.cluster import wait_until_idle
from tests.helpers.http_server import MODEL

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


def _body(path: str, **fields) -> bytes:
    base = {"model": MODEL, "max_tokens": 2}
    base.update({"prompt": "hi"} if path == CMPL else {"messages": [{"role": "user", "content": "hi"}]})
    base.update(fields)
    return json.dumps(base).encode()


ROWS = [
    # (name, path, raw body, status, param)
    ("lone surrogate in a prompt", CMPL, _body(CMPL).replace(b'"hi"', b'"a\\ud800b"'), 400, "prompt"),
    ("lone surrogate in a message", CHAT, _body(CHAT).replace(b'"hi"', b'"a\\udfffb"'), 400, "messages"),
    ("invalid UTF-8", CMPL, _body(CMPL).replace(b'"hi"', b'"\xff\xfe"'), 400, None),
    ("nesting 100k deep", CMPL, b'{"model": "x", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("not JSON", CMPL, b"{nope", 400, None),
    ("temperature Infinity", CMPL, _body(CMPL).replace(b'"max_tokens": 2', b'"max_tokens": 2, "temperature": Infinity'),
     400, "temperature"),
    ("repetition_penalty NaN", CHAT,
     _body(CHAT).replace(b'"max_tokens": 2', b'"max_tokens": 2, "repetition_penalty": NaN'), 400, "repetition_penalty"),
    ("timeout Infinity", CMPL, _body(CMPL).replace(b'"max_tokens": 2', b'"max_tokens": 2, "timeout": Infinity'),
     400, "timeout"),
    ("chat max_tokens 0", CHAT, _body(CHAT, max_tokens=0), 400, "max_tokens"),
    ("chat max_completion_tokens 0", CHAT, _body(CHAT, max_completion_tokens=0), 400, "max_tokens"),
    ("best_of 3", CMPL, _body(CMPL, best_of=3), 400, "best_of"),
    ("65 prompts", CMPL, _body(CMPL, prompt=["p"] * 65), 400, "prompt"),
    ("n x prompts over 256", CMPL, _body(CMPL, prompt=["p"] * 20, n=16), 400, "n"),
    ("17 stop strings", CMPL, _body(CMPL, stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("a 257-char stop string", CHAT, _body(CHAT, stop=["x" * 257]), 400, "stop"),
    ("1025 logit_bias entries", CMPL, _body(CMPL, logit_bias={str(i): 1.0 for i in range(1025)}), 400, "logit_bias"),
    ("unknown model", CMPL, _body(CMPL, model="gpt-4"), 404, "model"),
    ("no such path", "/v1/nothing", _body(CMPL), 404, None),
    ("embeddings (not served)", "/v1/embeddings", _body(CMPL), 404, None),
    ("score (not served)", "/v1/score", _body(CMPL), 404, None),
    ("rerank (not served)", "/v1/rerank", _body(CMPL), 404, None),
    ("GET-only path", "/v1/models", _body(CMPL), 405, None),
    ("chat max_tokens past the context", CHAT, _body(CHAT, max_tokens=2048), 400, "max_tokens"),
    ("an unknown field", CMPL, _body(CMPL, foo_bar=1), 400, "foo_bar"),
    ("a field not served", CHAT, _body(CHAT, use_beam_search=True), 400, "use_beam_search"),
]


@pytest.mark.parametrize("name, path, raw, status, param", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_gets_a_clear_error(server, name, path, raw, status, param):
    cluster, base_url = server
    resp = httpx.post(base_url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]  # the OpenAI envelope, whatever failed
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    assert error["param"] == param, error
    assert httpx.get(base_url + "/health", timeout=30).status_code == 200
    state = wait_until_idle(cluster)
    assert all(w["used_blocks"] == 0 and w["reserved"] == 0 for w in state["workers"].values())


@pytest.mark.parametrize("path, param", [(CMPL, "prompt"), (CHAT, "messages")])
def test_text_longer_than_the_context_is_refused_before_tokenizing(server, path, param):
    """~1 MB of text (240k tokens) against a 2,048-token context: refused by its length in characters (the
    message says so), where it was tokenized whole first (~1.8 s of ingress CPU for 1 MB) and refused after."""
    cluster, base_url = server
    text = "hello world " * 80_000
    fields = {"prompt": text} if path == CMPL else {"messages": [{"role": "user", "content": text}]}
    resp = httpx.post(base_url + path, content=_body(path, **fields), headers={"Content-Type": "application/json"},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "characters" in error["message"] and "2048 tokens" in error["message"], error
    fits = "hello world " * 100  # the exact token check is still there for what the characters let through
    assert httpx.post(base_url + path, content=_body(path, **({"prompt": fits} if path == CMPL else {
        "messages": [{"role": "user", "content": fits}]})), headers={"Content-Type": "application/json"},
                      timeout=60).status_code == 200
