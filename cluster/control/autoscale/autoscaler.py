"""The autoscaler loop: every `autoscaler.interval_s` it reads each pool's load from the scheduler (all
shards), decides (mode load: load_policy.py; mode slo: slo_policy.py over the demand each shard saw,
demand.py), and resizes through `scaling.scale`, the drain-safe path `tandem scale` and /admin/scale
take, so a shrink never fails a request. In mode slo the model's step cost is refitted every interval on
the workers' own steps (online_fit.py, `autoscaler.slo.refit`).

It runs as a thread of the process that owns the cluster (`tandem serve`), beside the config watcher:
that process holds the workers' handles and spawns and stops them. A resize holds the loop only for its
role flips (`scale(..., wait=False)`): new workers start and removed ones drain meanwhile, and the next
decision counts a starting worker as its pool's and a draining one as gone, so a pool that needs more
while its last cold start is under way gets it (a 60 s weight load does not freeze the loop). The
cool-down counts from the resize's return. A worker that needs resources no node has waits for Ray's
autoscaler (`ray up`, KubeRay) to add a node, up to the scaling path's ready timeout; one that never
starts is stopped and the pool's count falls back, so the next interval asks again. Every decision is
logged with its inputs and kept for /metrics. In mode slo a pool that must grow does not wait for the
cool-down (its SLO is missed meanwhile); shrinking is held back by the policy's own window. Between decisions, every `autoscaler.slo.react_s`, mode slo also
checks whether the newest demand (since the last check) already needs a pool to grow (`SloPolicy.react`)
and grows it then: a new phase of traffic waits seconds, not the rest of the interval.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, replace

import ray

from cluster.control.scheduler.demand import DemandSample, joined, observed
from cluster.control.autoscale.load_policy import Bounds, Decision, decide
from cluster.control.autoscale.online_fit import OnlineFit
from cluster.control.scheduler.pool_load import PoolLoad, merged
from cluster.control.autoscale.slo_policy import Forecast, PoolModel, SloPolicy, SloTargets
from cluster.control.autoscale.profile import EngineProfile
from cluster.control.config import AutoscalerSection
from cluster.control.lifecycle.launch import role_of
from cluster.control.lifecycle.periodic import Periodic
from cluster.control.lifecycle.scaling import ResizeInProgress, scale

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
    react: bool = False  # a check between decisions (mode slo's react_s), not an interval's decision


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
        self._since: list[DemandSample] | None = None  # mode slo: each shard's demand since the last decision
        react_s = section.slo.react_s if self._slo is not None else 0.0
        self.react_s = react_s if 0 < react_s < section.interval_s else None
        self._next_decision = 0.0  # monotonic; set when the loop starts
        self._loop = Periodic("tandem-autoscaler", self.react_s or section.interval_s, self._step, lambda exc: log.error(
            "autoscaler: this interval failed; trying again at the next", exc_info=exc))

    def start(self) -> "Autoscaler":
        log.info("autoscaler on: mode %s, every %.0fs, cool-down %.0fs%s", self.section.mode, self.section.interval_s,
                 self.section.cooldown_s, f", growth checked every {self.react_s:g}s" if self.react_s else "")
        self._next_decision = time.monotonic() + self.section.interval_s
        self._loop.start()
        return self

    def stop(self) -> None:
        self._loop.stop()

    def _step(self) -> None:
        """The loop's step: an interval's decision when one is due, else (mode slo) a check for growth."""
        if self.react_s is None or time.monotonic() >= self._next_decision - self.react_s / 2:
            self._next_decision = time.monotonic() + self.section.interval_s
            self.tick()
        else:
            self.react()

    def tick(self) -> Record:
        """One interval: read, decide and (out of the cool-down) resize."""
        loads = self.read()
        current, bounds = self._pools()
        seen = None
        if self._slo is not None:
            # The model's error is judged at the workers that served, not at those still starting.
            seen = replace(self.observe(), serving={role: load.workers for role, load in loads.items()})
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

    def react(self) -> Record | None:
        """Mode slo between decisions: grow a pool now if the newest demand already needs it
        (`SloPolicy.react`); None when nothing had to grow. The cool-down does not hold growth back."""
        seen = self._observed(decision=False)
        current, bounds = self._pools()
        decision = self._slo.react(seen, current, bounds, self.section.max_workers)
        if not decision.replicas:
            return None
        outcome = self._resize(decision, current)
        record = Record(time.time(), self.read(), current, decision, outcome, seen, react=True)
        self.history.append(record)
        log.info("autoscaler (between decisions): %s -> %s (%s); %s", current, decision.replicas, outcome,
                 "; ".join(f"{role}: {why}" for role, why in decision.reasons.items()))
        return record

    def _pools(self) -> tuple[dict[str, int], dict[str, Bounds]]:
        pools = self.cluster.config.pools()
        return ({role: pool.replicas for role, pool in pools.items()},
                {role: Bounds(pool.min_replicas, pool.max_replicas) for role, pool in pools.items()})

    def read(self) -> dict[str, PoolLoad]:
        shards = ray.get([s.pool_load.remote() for s in self.cluster.schedulers], timeout=_READ_TIMEOUT_S)
        return merged(shards)

    def slo_corrections(self) -> dict[str, float]:
        """Mode slo's correction factors now (observed / predicted TTFT and TPOT); empty in mode load."""
        if self._slo is None:
            return {}
        return {"ttft": self._slo.corrections.ttft, "tpot": self._slo.corrections.tpot}

    def observe(self) -> Observed:
        """Mode slo: the interval's demand and latencies from every shard (since the last decision)."""
        return self._observed(decision=True)

    def _observed(self, decision: bool) -> Observed:
        """A decision's view runs from the last decision; a check's is the newest sample alone, as one that ran
        from the last decision would blend a new phase's lengths with the old one's. Each shard's samples
        between decisions are joined for the decision."""
        newest = ray.get([s.demand_sample.remote() for s in self.cluster.schedulers], timeout=_READ_TIMEOUT_S)
        since = newest
        if self._since is not None and len(self._since) == len(newest):
            since = [joined(before, now) for before, now in zip(self._since, newest)]
        self._since = None if decision else since
        seen = observed(since if decision else newest, self.section.slo.percentile, self._last_demand)
        if decision:
            self._last_demand = seen.demand
        return seen

    def _resize(self, decision: Decision, current: dict[str, int]) -> str:
        try:
            result = scale(self.cluster, decision.replicas, flips=self.section.flips, wait=False)
        except ResizeInProgress as exc:  # one by hand, or a shrink of a pool whose new workers still start
            return f"not now: {exc}"
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
