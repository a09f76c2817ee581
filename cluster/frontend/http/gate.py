"""The ingress gate: API key -> tenant, per-tenant rate limits, concurrency quota and KV share.

The tenant, never the request body, decides the prefix-cache salt, so one tenant can neither share
nor probe another's cache. Without configured keys there is one anonymous tenant and no limits. The
KV share is enforced where the KV is committed (cluster/control/scheduler/tenant_shares.py); the gate only says
what it is.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from cluster.frontend.http.protocol import ApiError


@dataclass(frozen=True)
class TenantLimits:
    tenant: str
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_concurrency: int | None = None
    kv_share: float | None = None  # of the pool's KV and admission queue; None: no limit


def tenant_limits(sections: dict, default_tokens_per_minute: float | None,
                  default_max_concurrency: int | None = None) -> dict[str, TenantLimits]:
    """API key -> limits, from the config's tenant sections: unset token rates and concurrency quotas take
    the defaults, unset KV shares are equal shares (a lone tenant has no KV limit)."""
    equal_share = 1.0 / max(1, len({t.tenant for t in sections.values()}))
    limits = {}
    for key, t in sections.items():
        share = t.kv_share if t.kv_share is not None else equal_share
        limits[key] = TenantLimits(t.tenant, t.requests_per_minute, t.tokens_per_minute or default_tokens_per_minute,
                                   t.max_concurrency or default_max_concurrency, share if share < 1.0 else None)
    return limits


class _Bucket:
    """A token bucket holding up to a minute's allowance, refilled continuously."""

    def __init__(self, per_minute: float):
        self.capacity = per_minute
        self.level = per_minute
        self.rate = per_minute / 60.0
        self.stamp = time.monotonic()

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0: available now). Amounts over capacity wait a full refill."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class Gate:
    def __init__(self, api_keys: dict[str, TenantLimits] | None):
        self._keys = api_keys or {}
        self._lock = threading.Lock()
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}
        self._in_flight: dict[str, int] = {}
        for limits in self._keys.values():
            if limits.requests_per_minute:
                self._requests[limits.tenant] = _Bucket(limits.requests_per_minute)
            if limits.tokens_per_minute:
                self._tokens[limits.tenant] = _Bucket(limits.tokens_per_minute)
        self._limits = {l.tenant: l for l in self._keys.values()}

    def authenticate(self, authorization: str | None) -> str | None:
        """The tenant of a request (None: no keys are configured). Raises 401."""
        if not self._keys:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        limits = self._keys.get(key.strip()) if scheme.lower() == "bearer" else None
        if limits is None:
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None,
                           "authentication_error")
        return limits.tenant

    def admit(self, tenant: str | None, tokens: int, requests: int = 1) -> None:
        """Take a request slot and its token cost, or raise 429 with Retry-After."""
        if tenant is None:
            return
        with self._lock:
            limits = self._limits[tenant]
            if limits.max_concurrency is not None and self._in_flight.get(tenant, 0) + requests > limits.max_concurrency:
                raise _too_many(f"tenant {tenant} has {limits.max_concurrency} requests in flight", 1.0)
            waits = [b.wait_for(n) for b, n in ((self._requests.get(tenant), requests), (self._tokens.get(tenant), tokens))
                     if b is not None]
            if any(waits):
                raise _too_many(f"tenant {tenant} is over its rate limit", max(waits))
            for b, n in ((self._requests.get(tenant), requests), (self._tokens.get(tenant), tokens)):
                if b is not None:
                    b.take(n)
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + requests

    def release(self, tenant: str | None, requests: int = 1, unused_tokens: int = 0) -> None:
        """Free request slots, and give back the tokens they were charged for but did not generate."""
        if tenant is None:
            return
        with self._lock:
            self._in_flight[tenant] -= requests
            bucket = self._tokens.get(tenant)
            if bucket is not None and unused_tokens > 0:
                bucket.give_back(unused_tokens)

    def kv_share(self, tenant: str | None) -> float | None:
        return None if tenant is None else self._limits[tenant].kv_share

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)


def _too_many(message: str, retry_after_s: float) -> ApiError:
    return ApiError(429, message, None, "rate_limit_error", {"Retry-After": str(max(1, round(retry_after_s + 0.5)))})
