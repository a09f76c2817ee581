"""`autoscaler.mode: slo`: pool sizes from the forecast demand, the performance model and the SLO.

Every interval the autoscaler gives this module what the last interval showed (`Observed`: arrivals,
mean prompt and output lengths, the SLO's percentile of TTFT and TPOT) and the pools' sizes then. It

1. forecasts the next interval's arrival rate (`Forecast`: the last value, or the last value plus its
   smoothed slope, which follows a ramp instead of lagging it by an interval and jumps with a step at
   once, where plain exponential smoothing would lag it) and lengths (the last), and adds the work still queued
   (requests without a first token, requests waiting for KV room) as demand to be served within the
   next interval;
2. keeps correction factors, observed / predicted TTFT and TPOT at the layout that served the interval
   (the workers serving, not those still starting: a cold start's wait is not the model's error),
   smoothed: what the model gets wrong on this hardware and traffic (queueing it approximates, a prefix
   cache it ignores, a noisy neighbour) scales the targets it sizes against, as Dynamo's planner does;
3. sizes each pool with the performance model (`PoolModel`): the fewest prefill workers whose predicted
   TTFT meets the corrected target at the forecast load, and the fewest decode workers whose predicted
   TPOT does and whose KV holds the requests in flight;
4. grows a pool at once, but shrinks it only to the largest size it wanted over the last
   `shrink_window_s` (the stabilization window of Kubernetes' HPA: one quiet interval does not release
   workers that the next busy one needs again), and fits the total into `max_workers`, the pools sharing
   it in proportion to need.
5. between decisions (`react`, every `autoscaler.slo.react_s`), grows a pool as soon as a few seconds
   of demand show it short, so a new phase of traffic waits seconds for its workers, not an interval.

The TTFT that corrects the prefill model runs from a request's placement to its first token: a wait for
KV room before placement is the decode pool's shortage, seen as `waiting`, and blaming it on prefill
would grow the wrong pool.

The model is closed-form, not the simulator: it is asked for every candidate size every interval.
Prefill: each worker an M/D/1 queue of whole prompts (service time: the profile's cost of the mean
prompt), TTFT = service + `_TAIL` x the mean wait (an exponential tail's 90th percentile is 2.3x its
mean). Decode: a worker holding b sequences of mean context c steps in t(b) = step_s(b, b*c); by
Little's law b = rate x output tokens x t(b) / workers, solved as a fixed point; TPOT = t(b).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from cluster.control.autoscale.load_policy import Bounds, Decision
from cluster.control.autoscale.profile import BatchShape, EngineProfile
from cluster.control.scheduler.demand import Demand, Observed

_TAIL = 2.3  # percentile / mean of the queueing wait (exponential tail, p90)
_CORRECTION_RANGE = (0.25, 4.0)  # a factor outside this says the model does not describe the pool at all
_SMOOTHING = 0.5  # weight of the newest interval in a correction factor


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float
    tpot_s: float


class Forecast:
    """The next interval's demand from the ones seen: `constant` (the last) or `trend` (Holt's linear
    smoothing of the rate; with the default alpha of 1 the level is the last rate and the slope is
    smoothed). Lengths are the last interval's: a new phase's lengths step, they do not ramp, and a slope
    through a step would forecast nonsense (a prompt of minus a thousand tokens)."""

    def __init__(self, kind: str = "trend", alpha: float = 1.0, beta: float = 0.5):
        if kind not in ("constant", "trend"):
            raise ValueError(f"forecast must be 'constant' or 'trend', got {kind!r}")
        self.kind, self.alpha, self.beta = kind, alpha, beta
        self._level: float | None = None
        self._slope = 0.0

    def update(self, seen: Demand) -> Demand:
        """Take an interval's demand; return the forecast of the next."""
        if self._level is None or self.kind == "constant":
            self._level = seen.rate
            return seen
        level = self.alpha * seen.rate + (1 - self.alpha) * (self._level + self._slope)
        self._slope = self.beta * (level - self._level) + (1 - self.beta) * self._slope
        self._level = level
        return replace(seen, rate=max(level + self._slope, 0.0))


class PoolModel:
    """Predicted TTFT and TPOT of a pool size at a demand, from an engine profile."""

    def __init__(self, profile: EngineProfile):
        self.profile = profile

    def ttft_s(self, workers: float, demand: Demand) -> float:
        """Prefill workers (or colocated ones' prefill share) -> TTFT percentile; inf past saturation."""
        service = self.profile.prefill_s(max(round(demand.prompt_tokens), 1))
        if workers <= 0:
            return math.inf
        load = demand.rate * service / workers
        if load >= 1.0:
            return math.inf
        return service + _TAIL * load * service / (2 * (1 - load))

    def tpot_s(self, workers: float, demand: Demand) -> float:
        """Decode workers -> TPOT; inf when their KV or batch limit cannot hold the requests in flight."""
        if workers <= 0:
            return math.inf
        limits = self.profile.engine
        context = demand.prompt_tokens + demand.output_tokens / 2
        blocks_each = math.ceil((demand.prompt_tokens + demand.output_tokens) / limits.block_size)
        most = min(limits.max_num_seqs, limits.num_kv_blocks // max(blocks_each, 1))
        step = self._decode_step_s(1.0, context)
        for _ in range(50):  # the fixed point b = rate * output * t(b) / workers converges in a few rounds
            batch = demand.rate * demand.output_tokens * step / workers
            if batch > most:
                return math.inf
            settled = self._decode_step_s(max(batch, 1.0), context)
            if abs(settled - step) <= 1e-6 * step:
                break
            step = settled
        return step

    def most_batch(self, target_s: float, demand: Demand) -> int:
        """The most sequences one decode worker holds with its step within `target_s` (at least 1)."""
        limits = self.profile.engine
        context = demand.prompt_tokens + demand.output_tokens / 2
        blocks_each = math.ceil((demand.prompt_tokens + demand.output_tokens) / limits.block_size)
        most = min(limits.max_num_seqs, limits.num_kv_blocks // max(blocks_each, 1))
        low, high = 1, max(most, 1)
        while low < high:  # the step time grows with the batch: the largest one within the target
            mid = (low + high + 1) // 2
            if self._decode_step_s(mid, context) <= target_s:
                low = mid
            else:
                high = mid - 1
        return low

    def _decode_step_s(self, batch: float, context: float) -> float:
        b = math.ceil(batch)
        return self.profile.step_s(BatchShape(decode_seqs=b, decode_context=round(b * (context + 1))))

    def fewest(self, predict, target_s: float, demand: Demand, most: int) -> int | None:
        """The fewest workers (1..most) whose prediction meets `target_s`; None if even `most` cannot."""
        if demand.rate <= 0:
            return 1
        for n in range(1, most + 1):
            if predict(n, demand) <= target_s:
                return n
        return None


@dataclass
class Corrections:
    """observed / predicted, per metric, smoothed; 1.0 until an interval has measured it."""

    ttft: float = 1.0
    tpot: float = 1.0

    def update(self, observed: Observed, predicted_ttft: float, predicted_tpot: float) -> None:
        self.ttft = _blend(self.ttft, observed.ttft_s, predicted_ttft)
        self.tpot = _blend(self.tpot, observed.tpot_s, predicted_tpot)


def _blend(factor: float, observed: float | None, predicted: float) -> float:
    if observed is None or not math.isfinite(predicted) or predicted <= 0:
        return factor
    low, high = _CORRECTION_RANGE
    fresh = min(max(observed / predicted, low), high)
    return (1 - _SMOOTHING) * factor + _SMOOTHING * fresh


@dataclass
class SloPolicy:
    """The decisions of mode slo, one interval after another (it remembers the forecast, the corrections
    and how long each pool has wanted to shrink)."""

    model: PoolModel
    slo: SloTargets
    interval_s: float
    forecast: Forecast = field(default_factory=Forecast)
    shrink_window_s: float = 60.0
    headroom: float = 0.0  # size for this fraction more than the forecast (a burst arrives before the next decision)
    # A pool held against shrinking gives its surplus to a pool that must grow: a role flip moves the
    # capacity without a cold start, so holding it idle beside a short pool buys nothing.
    flips: bool = False
    corrections: Corrections = field(default_factory=Corrections)
    _wanted: dict[str, deque] = field(default_factory=dict)  # role -> its last targets, newest last

    def decide(self, observed: Observed, current: dict[str, int], bounds: dict[str, Bounds],
               max_workers: int | None) -> Decision:
        """The pools to resize for the next interval (`current`: the sizes that served `observed`)."""
        serving = observed.serving or {}
        served = {role: serving.get(role, n) for role, n in current.items()}  # the pools' own roles only
        self.corrections.update(observed, *self._predicted(observed.demand, served))
        demand = self.forecast.update(observed.demand)
        demand = replace(demand, rate=demand.rate * (1 + self.headroom))
        needs, reasons = self._needs(demand, observed, current, bounds)
        target = _within_budget(needs, bounds, max_workers)
        window = max(1, math.ceil(self.shrink_window_s / self.interval_s))
        held = {}
        for role, n in target.items():
            # Before the first decisions the pool's own size stands for what was wanted.
            wanted = self._wanted.setdefault(role, deque([current[role]] * window, maxlen=window))
            wanted.append(n)
            held[role] = min(max(wanted), current[role])
        return self._settle(target, held, current, max_workers, reasons)

    def react(self, observed: Observed, current: dict[str, int], bounds: dict[str, Bounds],
              max_workers: int | None) -> Decision:
        """Between decisions: grow a pool now if the demand of a shorter window (`observed`, the newest
        seconds) already needs it, rather than miss the SLO for the rest of the interval. It shrinks only
        what a growing pool takes by a flip or for the budget. The forecast and the corrections are the
        interval decisions' alone; the size a pool grows to counts as wanted in the shrink window.

        A window of a few seconds holds few arrivals, so it acts only for the rate it is sure of: one standard
        deviation (Poisson) below the count seen must already need a pool to grow. A new phase passes that
        at once; noise does not (a worker started for noise would be held for the whole shrink window).
        Once sure, it sizes for the rate seen: a pool sized short at a phase's start keeps the requests it
        took on too few workers until they end, long after the pool has grown."""
        count = observed.demand.rate * observed.seconds
        sure_rate = (count - math.sqrt(count)) / observed.seconds if count > 1 else (
            0.0 if observed.seconds else observed.demand.rate)
        sure, _ = self._needs(replace(observed.demand, rate=sure_rate * (1 + self.headroom)), observed, current, bounds)
        short = {role for role in sure if sure[role] > current[role]}
        demand = replace(observed.demand, rate=observed.demand.rate * (1 + self.headroom))
        needs, reasons = self._needs(demand, observed, current, bounds)
        target = _within_budget(needs, bounds, max_workers)
        if not short:
            return Decision({}, reasons)
        for role in target.keys() - short:  # a pool not surely short does not grow between decisions
            target[role] = min(target[role], current[role])
        decision = self._settle(target, dict(current), current, max_workers, reasons)
        for role, n in decision.replicas.items():
            wanted = self._wanted.get(role)
            if wanted and n > current[role]:  # wanted in this interval: the next decision must not shrink it at once
                wanted[-1] = max(wanted[-1], n)
        return decision

    def _settle(self, target: dict[str, int], held: dict[str, int], current: dict[str, int],
                max_workers: int | None, reasons: dict[str, str]) -> Decision:
        """Sizes from each pool's target: a pool grows to it at once and shrinks only to what it `held`."""
        sizes = {}
        for role, n in target.items():
            sizes[role] = n if n >= current[role] else held[role]
            if sizes[role] > n:
                reasons[role] = f"hold (wanted {sizes[role]} within the last {self.shrink_window_s:g}s): " + reasons[role]
        # A pool held against shrinking gives up what the budget needs for the pools that must grow (with
        # flips: what they grow by, whatever the budget).
        over = 0 if max_workers is None else sum(sizes.values()) - max_workers
        growth = sum(max(sizes[role] - current[role], 0) for role in sizes)
        why = "to flip into the pool that grows" if self.flips and growth > over else "for the budget (autoscaler.max_workers)"
        over = max(over, growth) if self.flips else over
        for role in sorted(sizes, key=lambda r: sizes[r] - target[r], reverse=True):
            give = min(max(over, 0), sizes[role] - target[role])
            if give > 0:
                sizes[role] -= give
                over -= give
                reasons[role] = f"shrink to {sizes[role]} {why}: " + reasons[role]
        return Decision({role: n for role, n in sizes.items() if n != current[role]}, reasons)

    def _predicted(self, demand: Demand, current: dict[str, int]) -> tuple[float, float]:
        """The model's TTFT and TPOT for the interval just seen, at the sizes that served it."""
        if "colocated" in current:
            n = current["colocated"]
            return self.model.ttft_s(n, demand), self.model.tpot_s(n, demand)
        return self.model.ttft_s(current["prefill"], demand), self.model.tpot_s(current["decode"], demand)

    def _needs(self, demand: Demand, observed: Observed, current: dict[str, int], bounds: dict[str, Bounds]
               ) -> tuple[dict[str, int], dict[str, str]]:
        ttft_target = self.slo.ttft_s / self.corrections.ttft
        tpot_target = self.slo.tpot_s / self.corrections.tpot
        # What is queued now must be served within the next interval on top of what arrives in it.
        prompts = replace(demand, rate=demand.rate + (observed.queued - observed.waiting) / self.interval_s)
        decodes = replace(demand, rate=demand.rate + observed.waiting / self.interval_s)
        said = (f"forecast {demand.rate:.2f} req/s, {demand.prompt_tokens:.0f} in / {demand.output_tokens:.0f} out, "
                f"{observed.queued} queued; corrections TTFT x{self.corrections.ttft:.2f} TPOT x{self.corrections.tpot:.2f}")
        if "colocated" in current:
            most = bounds["colocated"].most
            p = self.model.fewest(self.model.ttft_s, ttft_target, prompts, most)
            d = self.model.fewest(self.model.tpot_s, tpot_target, decodes, most)
            n = most if p is None or d is None else p + d  # a colocated worker does both jobs: their sum
            return {"colocated": n}, {"colocated": f"{n} workers for TTFT and TPOT ({said})"}
        needs, reasons = {}, {}
        for role, predict, target, load in (("prefill", self.model.ttft_s, ttft_target, prompts),
                                            ("decode", self.model.tpot_s, tpot_target, decodes)):
            n = self.model.fewest(predict, target, load, bounds[role].most)
            metric = "TTFT" if role == "prefill" else "TPOT"
            needs[role] = bounds[role].most if n is None else n
            reasons[role] = (f"{needs[role]} workers for {metric} <= {target:.3f}s" +
                             (" (none meets it: the most)" if n is None else "") + f" ({said})")
        # The requests in flight now are the decode pool's load whatever the forecast says: the lengths of
        # a new phase's answers show in finished requests only once they end, its KV use at once.
        held = observed.decoding + observed.waiting
        per_worker = self.model.most_batch(tpot_target, demand)
        if held and math.ceil(held / per_worker) > needs["decode"]:
            needs["decode"] = min(math.ceil(held / per_worker), bounds["decode"].most)
            reasons["decode"] = (f"{needs['decode']} workers to hold the {held} requests in flight or waiting at "
                                 f"{per_worker} each ({said})")
        return needs, reasons


def _within_budget(needs: dict[str, int], bounds: dict[str, Bounds], max_workers: int | None) -> dict[str, int]:
    """Each pool's need within its bounds; past the total budget the pools share what is above their minimums
    in proportion to what they need above them."""
    target = {role: min(max(n, bounds[role].least), bounds[role].most) for role, n in needs.items()}
    if max_workers is None or sum(target.values()) <= max_workers:
        return target
    floor = {role: bounds[role].least for role in target}
    spare = max_workers - sum(floor.values())
    wanted = {role: target[role] - floor[role] for role in target}
    total = sum(wanted.values())
    if spare <= 0 or total == 0:  # the pools' minimums alone fill (or pass) the budget
        return floor
    share = {role: floor[role] + math.floor(spare * wanted[role] / total) for role in target}
    left = max_workers - sum(share.values())
    for role in sorted(target, key=lambda r: wanted[r] * spare / total - math.floor(wanted[r] * spare / total),
                       reverse=True)[:left]:
        share[role] += 1
    return share
