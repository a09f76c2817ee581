"""The autoscaler on /metrics (`tandem:autoscaler_*`): the inputs of its last interval, the pools' sizes and
the resizes it made. Read at scrape time from the autoscaler's own record, in the serve process."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class AutoscalerCollector(Collector):
    def __init__(self, autoscaler) -> None:
        self._autoscaler = autoscaler

    def collect(self):
        a = self._autoscaler
        replicas = GaugeMetricFamily("tandem:autoscaler_replicas", "workers of each pool as the autoscaler sizes it",
                                     labels=["pool"])
        for role, pool in a.cluster.config.pools().items():
            replicas.add_metric([role], pool.replicas)
        resizes = CounterMetricFamily("tandem:autoscaler_resizes", "resizes the autoscaler made, by pool and direction",
                                      labels=["pool", "direction"])
        for (role, direction), n in sorted(a.resizes.items()):
            resizes.add_metric([role, direction], n)
        flips = CounterMetricFamily("tandem:autoscaler_flips", "workers the autoscaler turned from one pool into another",
                                    labels=["from_pool", "to_pool"])
        for (source, target), n in sorted(a.flips.items()):
            flips.add_metric([source, target], n)
        families = [replicas, resizes, flips]
        last = a.history[-1] if a.history else None
        if last is not None:
            queue = GaugeMetricFamily("tandem:autoscaler_queued_prefill_seconds_per_worker",
                                      "prompts queued per worker in seconds of work, at the last interval", labels=["pool"])
            kv = GaugeMetricFamily("tandem:autoscaler_kv_committed", "fraction of the pool's KV committed to requests "
                                   "in flight, at the last interval", labels=["pool"])
            waiting = GaugeMetricFamily("tandem:autoscaler_waiting_requests", "requests waiting for KV room in the "
                                        "pool, at the last interval", labels=["pool"])
            for role, load in last.loads.items():
                queue.add_metric([role], load.queue_s_per_worker)
                kv.add_metric([role], load.kv_used)
                waiting.add_metric([role], load.waiting)
            if last.observed is not None:
                families += _slo_families(last.observed, a.slo_corrections())
            at = GaugeMetricFamily("tandem:autoscaler_last_decision_timestamp_seconds", "when the last interval ran")
            at.add_metric([], last.at)
            families += [queue, kv, waiting, at]
        yield from families


def _slo_families(seen, corrections) -> list[GaugeMetricFamily]:
    """Mode slo: the last interval's demand and latencies, and the model's correction factors."""
    out = []
    for name, help_, value in (
        ("arrival_rate", "requests/s that arrived in the last interval", seen.demand.rate),
        ("prompt_tokens_mean", "mean prompt tokens of the last interval's arrivals", seen.demand.prompt_tokens),
        ("max_tokens_mean", "mean max_tokens of the last interval's arrivals", seen.demand.output_tokens),
        ("first_token_wait_seconds", "the SLO percentile of worker receive -> first token, last interval", seen.ttft_s),
        ("decode_step_seconds", "the slowest decode worker's step time (its TPOT), at the last interval", seen.tpot_s),
    ):
        if value is not None:
            family = GaugeMetricFamily(f"tandem:autoscaler_{name}", help_)
            family.add_metric([], value)
            out.append(family)
    factor = GaugeMetricFamily("tandem:autoscaler_correction", "observed / predicted by the profile, smoothed",
                               labels=["metric"])
    for metric, value in corrections.items():
        factor.add_metric([metric], value)
    return out + [factor]
