"""Stored responses: what `store` keeps and `previous_response_id` / `GET /v1/responses/{id}` (and
`GET /v1/chat/completions/{id}`) read back, in the ingress's memory.

Each tenant has its own store (a tenant never sees another's ids, and one tenant's volume cannot evict
another's), bounded in entries and in bytes (the JSON size of what is kept); the least recently used
entry goes first. A restart of the ingress forgets everything, as the README says: this is the
conversation state of the Agents SDK and of chat apps, not a database.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    body: dict  # the response object as it was answered
    conversation: tuple[dict, ...]  # Responses: the input items of the whole chain, then this answer's output
    nbytes: int


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tenants: dict[str | None, OrderedDict[str, Stored]] = {}
        self._bytes: dict[str | None, int] = {}
        self._lock = threading.Lock()  # a large body is built, and stored, on a worker thread (responses.py)

    def put(self, tenant: str | None, body: dict, conversation: list[dict] = ()) -> None:
        nbytes = len(json.dumps(body)) + len(json.dumps(list(conversation)))
        if nbytes > self.max_bytes:
            return  # larger than the whole store: kept nowhere (a later read is a clean 404)
        with self._lock:
            self._put(tenant, body, conversation, nbytes)

    def _put(self, tenant: str | None, body: dict, conversation, nbytes: int) -> None:
        entries = self._tenants.setdefault(tenant, OrderedDict())
        self._drop(tenant, body["id"])
        entries[body["id"]] = Stored(body, tuple(conversation), nbytes)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes
        while len(entries) > self.max_entries or self._bytes[tenant] > self.max_bytes:
            _, oldest = entries.popitem(last=False)
            self._bytes[tenant] -= oldest.nbytes

    def get(self, tenant: str | None, response_id: str) -> Stored | None:
        with self._lock:
            return self._get(tenant, response_id)

    def _get(self, tenant: str | None, response_id: str) -> Stored | None:
        entries = self._tenants.get(tenant)
        stored = entries.get(response_id) if entries else None
        if stored is not None:
            entries.move_to_end(response_id)
        return stored

    def drop(self, tenant: str | None, response_id: str) -> bool:
        with self._lock:
            return self._drop(tenant, response_id)

    def _drop(self, tenant: str | None, response_id: str) -> bool:
        entries = self._tenants.get(tenant)
        stored = entries.pop(response_id, None) if entries else None
        if stored is None:
            return False
        self._bytes[tenant] -= stored.nbytes
        return True

    def check_integrity(self) -> None:
        with self._lock:
            self._check()

    def _check(self) -> None:
        for tenant, entries in self._tenants.items():
            assert len(entries) <= self.max_entries, (tenant, len(entries))
            assert self._bytes.get(tenant, 0) == sum(s.nbytes for s in entries.values()) <= self.max_bytes, tenant
            assert all(s.body["id"] == rid for rid, s in entries.items()), tenant
