"""The stored responses: per tenant (one never reads another's id, nor evicts another's entries), bounded
in entries and bytes with the least recently used dropped first, and consistent after every change."""

from __future__ import annotations

import json

from cluster.frontend.http.response_store import ResponseStore


def body(rid: str, text: str = "x") -> dict:
    return {"id": rid, "object": "response", "output_text": text}


def test_tenants_are_apart():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    store.put("a", body("r1"))
    store.put("b", body("r2"))
    store.put("b", body("r3"))
    store.put("b", body("r4"))  # b's own oldest goes, a's stays
    assert store.get("a", "r1") is not None and store.get("b", "r1") is None and store.get(None, "r1") is None
    assert store.get("b", "r2") is None and store.get("b", "r4") is not None
    store.check_integrity()


def test_least_recently_used_goes_first_within_the_bounds():
    one = len(json.dumps(body("r0", "y" * 100))) + len(json.dumps([]))
    store = ResponseStore(max_entries=10, max_bytes=3 * one)
    for i in range(3):
        store.put(None, body(f"r{i}", "y" * 100))
    assert store.get(None, "r0") is not None  # read: now the most recent
    store.put(None, body("r3", "y" * 100))  # over the bytes: r1 goes, not r0
    assert store.get(None, "r1") is None and store.get(None, "r0") is not None
    store.put(None, body("big", "y" * 10 * one))  # larger than the store: kept nowhere, nothing else lost
    assert store.get(None, "big") is None and store.get(None, "r3") is not None
    assert store.drop(None, "r3") and not store.drop(None, "r3")
    store.put(None, body("r0", "z"), [{"role": "user", "content": "hi"}])  # the same id again: replaced
    assert store.get(None, "r0").body["output_text"] == "z"
    store.check_integrity()
