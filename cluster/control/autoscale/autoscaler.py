"""The autoscaler loop: every `autoscaler.interval_s` it reads each pool's load from the scheduler (all
shards), decides (mode load: load_policy.py; mode slo: slo_policy.py over the demand each shard saw,
demand.py), and resizes through `scaling.scale`, the drain-safe path `tandem scale` and /admin/scale
take, so a shrink never fails a request. In mode slo the model's step cost is refitted every interval on
the workers' own steps (online_fit.py, `autoscaler.slo.refit`).

It runs as a thread of the process that owns the cluster (`tandem serve`), beside the config watcher:
that process holds the workers' handles and spawns and stops them. A resize blocks the loop until the
new workers are ready or the removed ones drained; the cool-down counts from its end. A worker that
needs resources no node has waits for Ray's autoscaler (`ray up`, KubeRay) to add a node, up to the
scaling path's ready timeout. Every decision is logged with its inputs and kept for /metrics. In mode
slo a pool that must grow does not wait for the cool-down (its SLO is missed meanwhile); shrinking is
held back by the policy's own window.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass

import ray

from cluster.control.autoscale.demand import observed
from cluster.control.autoscale.load_policy import Bounds, Decision, decide
from cluster.control.autoscale.online_fit import OnlineFit
from cluster.control.autoscale.pool_load import PoolLoad, merged
from cluster.control.autoscale.slo_policy import Demand, Forecast, Observed, PoolModel, SloPolicy, SloTargets
from cluster.control.capacity.profile import EngineProfile
from cluster.control.config import AutoscalerSection
from cluster.control.launch import role_of
from cluster.control.periodic import Periodic
from cluster.control.scaling import ResizeInProgress, scale

log = logging.getLogger("tandem.autoscaler")
_READ_TIMEOUT_S = 10.0
_HISTORY = 256


@dataclass(frozen=True)
class Record:
    """One interval: what was read, what was decided, what came of it."""

    at: float  # time.time()
    loads: dict[str, PoolLoad]
    replicas: dict[str, int]  # before the decision
    decision: Decision
    outcome: str  # "held", "resized", "cooling down", or the error
    observed: Observed | None = None  # mode slo: the interval's demand and latencies


class Autoscaler:
    def __init__(self, cluster, section: AutoscalerSection):
        self.cluster, self.section = cluster, section
        self.history: deque[Record] = deque(maxlen=_HISTORY)
        self.resizes: Counter[tuple[str, str]] = Counter()  # (pool, "up" | "down") -> resizes done
        self.flips: Counter[tuple[str, str]] = Counter()  # (from pool, to pool) -> workers flipped
        self._last_resize = float("-inf")  # monotonic end of the last resize
        self._slo = _slo_policy(section) if section.mode == "slo" else None
        self.fit = OnlineFit(self._slo.model.profile) if self._slo is not None and section.slo.refit else None
        self._last_demand: Demand | None = None
        self._loop = Periodic("tandem-autoscaler", section.interval_s, self.tick, lambda exc: log.error(
            "autoscaler: this interval failed; trying again at the next", exc_info=exc))

    def start(self) -> "Autoscaler":
        log.info("autoscaler on: mode %s, every %.0fs, cool-down %.0fs", self.section.mode, self.section.interval_s,
                 self.section.cooldown_s)
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()

    def tick(self) -> Record:
        """One interval: read, decide and (out of the cool-down) resize."""
        loads = self.read()
        pools = self.cluster.config.pools()
        current = {role: pool.replicas for role, pool in pools.items()}
        bounds = {role: Bounds(pool.min_replicas, pool.max_replicas) for role, pool in pools.items()}
        seen = None
        if self._slo is not None:
            seen = self.observe()
            fitted = self.fit.update(dict(self.cluster.workers)) if self.fit is not None else None
            if fitted is not None:
                self._slo.model.profile = fitted
            decision = self._slo.decide(seen, current, bounds, self.section.max_workers)
        else:
            decision = decide(loads, current, bounds, self.section.load, self.section.max_workers)
        outcome = "held"
        if decision.replicas:
            growing = any(n > current[role] for role, n in decision.replicas.items())
            if time.monotonic() - self._last_resize < self.section.cooldown_s and not (self._slo and growing):
                outcome = "cooling down"
            else:
                outcome = self._resize(decision, current)
        record = Record(time.time(), loads, current, decision, outcome, seen)
        self.history.append(record)
        level = logging.INFO if decision.replicas else logging.DEBUG
        log.log(level, "autoscaler: %s -> %s (%s); %s", current, decision.replicas or "no change", outcome,
                "; ".join(f"{role}: {why}" for role, why in decision.reasons.items()))
        return record

    def read(self) -> dict[str, PoolLoad]:
        shards = ray.get([s.pool_load.remote() for s in self.cluster.schedulers], timeout=_READ_TIMEOUT_S)
        return merged(shards)

    def slo_corrections(self) -> dict[str, float]:
        """Mode slo's correction factors now (observed / predicted TTFT and TPOT); empty in mode load."""
        if self._slo is None:
            return {}
        return {"ttft": self._slo.corrections.ttft, "tpot": self._slo.corrections.tpot}

    def observe(self) -> Observed:
        """Mode slo: the interval's demand and latencies from every shard."""
        samples = ray.get([s.demand_sample.remote() for s in self.cluster.schedulers], timeout=_READ_TIMEOUT_S)
        seen = observed(samples, self.section.slo.percentile, self._last_demand)
        self._last_demand = seen.demand
        return seen

    def _resize(self, decision: Decision, current: dict[str, int]) -> str:
        try:
            result = scale(self.cluster, decision.replicas, flips=self.section.flips)
        except ResizeInProgress:
            return "a resize by hand is in progress"
        except ValueError as exc:  # e.g. no node can take a new worker before the ready timeout
            return f"resize failed: {exc}"
        finally:
            self._last_resize = time.monotonic()
        for role, n in decision.replicas.items():
            self.resizes[(role, "up" if n > current[role] else "down")] += 1
        for flipped in result["flipped"]:
            self.flips[(role_of(flipped["from"]), role_of(flipped["to"]))] += 1
        return f"resized ({len(result['flipped'])} by role flips)" if result["flipped"] else "resized"


def _slo_policy(section: AutoscalerSection) -> SloPolicy:
    slo = section.slo
    try:
        profile = EngineProfile.load(slo.profile)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"autoscaler.slo.profile {slo.profile!r}: {exc}") from None
    return SloPolicy(PoolModel(profile), SloTargets(slo.ttft_ms / 1000, slo.tpot_ms / 1000), section.interval_s,
                     Forecast(slo.forecast), shrink_window_s=slo.shrink_window_s, headroom=slo.headroom,
                     flips=section.flips)
