"""The ingress's latency histograms carry the pool that made each latency, and KV use is exported per worker
(the Grafana dashboard's panels by pool and by worker read them)."""

from __future__ import annotations

import dataclasses

from actors.protocol.messages import Admitted, WorkerStats
from cluster.frontend.http.metrics import IngressMetrics


def test_latency_is_labelled_with_the_pool_that_made_it():
    """TTFT: the pool that computed the first token (the decode pool when it prefilled the prompt itself);
    TPOT and ITL: the pool of the last attempt's decode worker (after a move); KV use per worker and pool."""
    metrics = IngressMetrics()
    handed = Admitted("prefill-0", "decode-1")
    metrics.observe_emits(0.0, [0.5, 0.6, 0.8], [handed])
    metrics.observe_emits(0.0, [0.2, 0.3], [Admitted("prefill-0", "decode-1", local=True), Admitted("prefill-1", "decode-4")])
    metrics.observe_emits(0.0, [1.0], [Admitted("colocated-2", "colocated-2")])
    stats = WorkerStats(*(["decode-1", "decode"] + [0] * 20))
    metrics.update_workers({"decode-1": dataclasses.replace(stats, num_blocks=8, used_blocks=2)})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in metrics.registry.collect() for s in family.samples}
    count = lambda name, **labels: samples.get((f"tandem:{name}_count", tuple(sorted(labels.items()))))  # noqa: E731
    assert count("time_to_first_token_seconds", pool="prefill") == 1
    assert count("time_to_first_token_seconds", pool="decode") == 1  # prefilled on its decode worker
    assert count("time_to_first_token_seconds", pool="colocated") == 1
    assert count("time_per_output_token_seconds", pool="decode") == 2 and count("inter_token_latency_seconds", pool="decode") == 3
    assert samples[("tandem:worker_kv_usage", (("pool", "decode"), ("worker", "decode-1")))] == 0.25
