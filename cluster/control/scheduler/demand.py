"""What mode slo reads of a scheduler shard each interval: the demand that arrived and how the pools served it.

The scheduler feeds a `DemandWindow` as requests arrive (prompt length and `max_tokens`: what admission
reserves KV for) and as workers report their first-token waits (a worker receiving an attempt to its
first token: the prefill pool's share of TTFT, without any wait for KV room). The autoscaler takes a
`DemandSample` every interval, which also carries the state at that moment: the decode pool's step
times (its TPOT), prompts queued on the prefill pool, requests waiting for KV room and requests
holding it. `observed` merges the shards' samples into the one `Observed` the policy decides on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

_MOST_SAMPLES = 4096  # first-token waits kept per interval: a percentile needs no more


@dataclass(frozen=True)
class Demand:
    rate: float  # requests/s
    prompt_tokens: float  # mean
    output_tokens: float  # mean


@dataclass(frozen=True)
class Observed:
    """One interval as the frontend saw it."""

    demand: Demand  # arrivals (refused ones too: they are demand) and the mean lengths
    ttft_s: float | None  # the SLO's percentile of placement -> first token over the interval; None: none came
    tpot_s: float | None
    queued: int = 0  # at the interval's end: requests admitted or waiting that have no first token yet
    waiting: int = 0  # of them, those waiting for KV room on a decode (or colocated) worker (not yet a prefill's)
    decoding: int = 0  # at the interval's end: requests holding KV on a decode (or colocated) worker
    seconds: float = 0.0  # the interval's length (0: unknown)
    # At the interval's end: the workers per pool that take new work (starting and draining ones left out);
    # None: the pools' sizes. A pool still starting workers it was asked for served at this size, not that.
    serving: dict[str, int] | None = None


@dataclass(frozen=True)
class DemandSample:
    seconds: float  # the interval this sample covers
    arrivals: int  # new requests (migrations and re-routes are not demand)
    prompt_tokens: int  # their prompt tokens, summed
    max_tokens: int  # their max_tokens, summed
    first_token_waits: tuple[float, ...]
    decode_step_s: tuple[float, ...]  # every decode (or colocated) worker's smoothed step time, now
    queued_prefill_tokens: int  # prompt tokens queued on the workers that prefill, now
    waiting: int  # requests waiting for KV room, now
    holding: int  # requests holding KV on a decode (or colocated) worker, now


class DemandWindow:
    """Arrivals and first-token waits since the last `take`; owned by the scheduler."""

    def __init__(self) -> None:
        self._since = time.monotonic()
        self._arrivals = self._prompt_tokens = self._max_tokens = 0
        self._waits: deque[float] = deque(maxlen=_MOST_SAMPLES)

    def arrived(self, prompt_tokens: int, max_tokens: int) -> None:
        self._arrivals += 1
        self._prompt_tokens += prompt_tokens
        self._max_tokens += max_tokens

    def first_tokens(self, seconds: list[float]) -> None:
        self._waits.extend(seconds)

    def take(self, workers, kv_pool: str, waiting: int, holding: int) -> DemandSample:
        """The window so far, and the pools now: `workers` the registry's entries, `kv_pool` the role that
        holds requests' KV while they decode."""
        steps = tuple(e.stats.step_s for e in workers
                      if e.info.role == kv_pool and e.stats is not None and e.stats.step_s is not None)
        prefilling = sum(e.view.queued_prefill_tokens for e in workers if e.info.role != "decode")
        now = time.monotonic()
        sample = DemandSample(now - self._since, self._arrivals, self._prompt_tokens, self._max_tokens,
                              tuple(self._waits), steps, prefilling, waiting, holding)
        self.__init__()
        self._since = now
        return sample

    def check_integrity(self) -> None:
        if min(self._arrivals, self._prompt_tokens, self._max_tokens) < 0 or any(w < 0 for w in self._waits):
            raise RuntimeError(f"demand window: negative counts or waits ({self._arrivals} arrivals)")


def joined(earlier: DemandSample, later: DemandSample) -> DemandSample:
    """Two consecutive samples of one shard as one: both windows' arrivals and waits, the later one's state."""
    return DemandSample(earlier.seconds + later.seconds, earlier.arrivals + later.arrivals,
                        earlier.prompt_tokens + later.prompt_tokens, earlier.max_tokens + later.max_tokens,
                        (earlier.first_token_waits + later.first_token_waits)[-_MOST_SAMPLES:], later.decode_step_s,
                        later.queued_prefill_tokens, later.waiting, later.holding)


def observed(samples: list[DemandSample], percentile: float, last: Demand | None) -> Observed:
    """The shards' samples as one interval. An interval with no arrivals keeps the last lengths."""
    seconds = max(max((s.seconds for s in samples), default=0.0), 1e-9)
    arrivals = sum(s.arrivals for s in samples)
    if arrivals:
        prompt = sum(s.prompt_tokens for s in samples) / arrivals
        output = sum(s.max_tokens for s in samples) / arrivals
    else:
        prompt, output = (last.prompt_tokens, last.output_tokens) if last else (1.0, 1.0)
    waits = [w for s in samples for w in s.first_token_waits]
    steps = [t for s in samples for t in s.decode_step_s]
    return Observed(
        Demand(arrivals / seconds, prompt, output),
        float(np.percentile(waits, percentile)) if waits else None,
        max(steps) if steps else None,  # the slowest decode worker's step is its requests' TPOT
        queued=round(sum(s.queued_prefill_tokens for s in samples) / max(prompt, 1.0)) + sum(s.waiting for s in samples),
        waiting=sum(s.waiting for s in samples),
        decoding=sum(s.holding for s in samples),
        seconds=seconds,
    )
