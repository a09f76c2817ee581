"""Prometheus metrics of the ingress, named `tandem:*`, in a registry of their own.

Latencies follow DESIGN.md: TTFT = first emit - arrival at the ingress, ITL = gap between emits,
TPOT = (last emit - first emit) / (N - 1). Each is labelled with the pool that made it: TTFT the pool whose
worker computed the first token (prefill, or decode for a prompt its decode worker prefilled itself, or
colocated), ITL and TPOT the pool of the worker that decoded the rest (of the last attempt, after a move).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from actors.protocol.messages import Admitted, StageTimes, WorkerStats
from cluster.control.lifecycle.launch import role_of
from cluster.control.scheduler.routing import WorkerView

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngressMetrics:
    def __init__(self, tenant_labels: bool = False) -> None:
        """`tenant_labels`: export per-tenant series. /metrics has no authentication, and a tenant's name and
        its live KV would tell anyone who uses the cluster and how much (ingress.metrics_tenant_labels)."""
        self.registry = CollectorRegistry()
        self.tenant_labels = tenant_labels
        r = self.registry
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "first emit - arrival, by the pool that computed "
                              "the first token", ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "gap between emits, by the pool that decoded",
                             ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tandem:time_per_output_token_seconds", "(last - first emit) / (N - 1), by the pool "
                              "that decoded", ["pool"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "finish - arrival", buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("tandem:requests_finished", "requests finished, by finish reason", ["reason"], registry=r)
        self.rejected = Counter("tandem:requests_rejected", "requests rejected, by reason", ["reason"], registry=r)
        self.migrations = Counter("tandem:request_migrations", "requests resubmitted after their worker was lost", registry=r)
        self.stalls = Counter("tandem:request_stalls", "times a request made no progress within the progress bound "
                              "(scheduler.progress_timeout_s): moved the first time, ended the second", registry=r)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("tandem:generation_tokens", "tokens emitted to clients", registry=r)
        self.running = Gauge("tandem:pool_running_requests", "running sequences per pool", ["pool"], registry=r)
        self.waiting = Gauge("tandem:pool_waiting_requests", "waiting sequences per pool", ["pool"], registry=r)
        self.kv_usage = Gauge("tandem:pool_kv_usage", "fraction of KV blocks in use per pool", ["pool"], registry=r)
        self.prefix_queries = Counter("tandem:prefix_cache_queries", "prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("tandem:prefix_cache_hits", "prompt tokens served from the prefix cache", registry=r)
        # Cumulative worker counters, as the workers last reported them (gauges: a restarted worker starts over).
        self.kv_bytes = Gauge("tandem:kv_transfer_bytes", "KV page bytes sent by prefill workers", registry=r)
        self.kv_transfers = Gauge("tandem:kv_transfers", "KV handoffs, by outcome", ["outcome"], registry=r)
        self.leases_expired = Gauge("tandem:kv_leases_expired", "handoff leases that expired", registry=r)
        self._tenants_seen: set[str] = set()
        self.tenant_kv = Gauge("tandem:tenant_kv_blocks", "KV blocks committed to each tenant's requests in flight",
                               ["tenant"], registry=r if tenant_labels else None)
        self.link_bandwidth = Gauge("tandem:kv_link_bytes_per_second",
                                    "KV handoff bandwidth per prefill -> decode link, as the scheduler measured it",
                                    ["link"], registry=r)
        self.link_latency = Gauge("tandem:kv_link_latency_seconds",
                                  "fixed cost of a KV handoff per link, as the scheduler measured it", ["link"],
                                  registry=r)
        self.worker_rss = Gauge("tandem:worker_rss_bytes", "resident memory of each worker process", ["worker"], registry=r)
        self.worker_kv = Gauge("tandem:worker_kv_usage", "fraction of each worker's KV blocks in use", ["worker", "pool"],
                               registry=r)
        # Summed over the ingress's token sink and every worker's KV receiver (each restarted worker starts over).
        self.dropped = Gauge("tandem:dropped_messages_total", "messages receive loops dropped, by socket and reason",
                             ["socket", "reason"], registry=r)
        self.rejected_handshakes = Gauge("tandem:rejected_handshakes_total",
                                         "CURVE handshakes of this ingress's sockets refused (not a cluster key)",
                                         registry=r)
        self.tier_bytes = Gauge("tandem:kv_tier_bytes", "KV bytes stored in each node's host tier", ["node"], registry=r)
        self.tier_hits = Gauge("tandem:kv_tier_hits_total", "blocks a worker's lookup found in the host tier",
                               ["node"], registry=r)
        self.tier_misses = Gauge("tandem:kv_tier_misses_total", "blocks a worker's lookup asked the host tier for "
                                 "and did not find", ["node"], registry=r)
        self.tier_loads = Gauge("tandem:kv_tier_loads_total", "blocks workers loaded from the host tier into their "
                                "pools", ["node"], registry=r)
        self.tier_evictions = Gauge("tandem:kv_tier_evictions_total", "blocks the host tier evicted (least recently "
                                    "used) to make room", ["node"], registry=r)
        self.queue_time = Histogram("tandem:request_queue_time_seconds", "arrival at a worker -> first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("tandem:request_prefill_time_seconds", "first scheduled -> first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.transfer_time = Histogram("tandem:request_kv_transfer_time_seconds", "first token -> adopted by decode",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.decode_time = Histogram("tandem:request_decode_time_seconds", "first token -> finished",
                                     buckets=_LATENCY_BUCKETS, registry=r)

    def observe_emits(self, arrival: float, emits: list[float], routes: list[Admitted]) -> None:
        """One finished sample: its emit times (one per token) against the request's arrival; `routes`: the
        workers of each of its attempts (`RequestStream.routes`)."""
        if not emits or not routes:
            return
        first, last = routes[0], routes[-1]
        self.ttft.labels(role_of(first.decode if first.local else first.prefill)).observe(emits[0] - arrival)
        itl = self.itl.labels(role_of(last.decode))
        for a, b in zip(emits, emits[1:]):
            itl.observe(b - a)
        if len(emits) > 1:
            self.tpot.labels(role_of(last.decode)).observe((emits[-1] - emits[0]) / (len(emits) - 1))
        self.e2e.observe(emits[-1] - arrival)

    def update_workers(self, stats: dict[str, WorkerStats]) -> None:
        workers = list(stats.values())
        self.kv_bytes.set(sum(w.kv_bytes_sent for w in workers))
        self.kv_transfers.labels("sent").set(sum(w.transfers_sent for w in workers))
        self.kv_transfers.labels("failed").set(sum(w.transfers_failed for w in workers))
        self.kv_transfers.labels("adopted").set(sum(w.adopted for w in workers))
        self.leases_expired.set(sum(w.leases_expired for w in workers))
        self.worker_rss.clear()  # a worker removed or flipped stops being exported
        self.worker_kv.clear()
        for worker_id, w in stats.items():
            self.worker_rss.labels(worker_id).set(w.rss_bytes)
            self.worker_kv.labels(worker_id, w.role).set(w.used_blocks / w.num_blocks if w.num_blocks else 0.0)
        drops: dict[tuple[str, str], int] = {}
        for w in workers:
            for socket, reason, n in w.dropped_messages:
                drops[socket, reason] = drops.get((socket, reason), 0) + n
        for (socket, reason), n in drops.items():
            self.dropped.labels(socket, reason).set(n)

    def update_tiers(self, tiers: dict) -> None:
        """`tiers`: each node's host KV tier's `TierStats`, by node id; a tier that went stops being exported."""
        gauges = (self.tier_bytes, self.tier_hits, self.tier_misses, self.tier_loads, self.tier_evictions)
        for gauge in gauges:
            gauge.clear()
        for node, t in tiers.items():
            for gauge, value in zip(gauges, (t.bytes, t.hits, t.misses, t.loads, t.evictions)):
                gauge.labels(node).set(value)

    def update_sockets(self, dropped: dict[str, dict[str, int]], rejected_handshakes: int) -> None:
        """`dropped`: by socket (the ingress's own and the schedulers'), by reason."""
        for socket, counts in dropped.items():
            for reason, n in counts.items():
                self.dropped.labels(socket, reason).set(n)
        self.rejected_handshakes.set(rejected_handshakes)

    def observe_phases(self, times: StageTimes) -> None:
        """Per-request phase durations from worker timestamps (wall clock, seconds)."""
        pairs = ((self.queue_time, times.received, times.scheduled),
                 (self.prefill_time, times.scheduled, times.first_token),
                 (self.transfer_time, times.first_token, times.adopted),
                 (self.decode_time, times.first_token, times.finished))
        for hist, start, end in pairs:
            if start is not None and end is not None:
                hist.observe(max(0.0, end - start))

    def update_pools(self, workers: dict[str, WorkerView]) -> None:
        pools: dict[str, list[WorkerView]] = {}
        for view in workers.values():
            pools.setdefault(view.role, []).append(view)
        for pool, views in pools.items():
            self.running.labels(pool).set(sum(v.running for v in views))
            self.waiting.labels(pool).set(sum(v.waiting for v in views))
            total = sum(v.num_blocks for v in views)
            self.kv_usage.labels(pool).set(1 - sum(v.free_blocks for v in views) / total if total else 0.0)

    def update_tenants(self, blocks: dict[str, int]) -> None:
        if not self.tenant_labels:
            return
        self._tenants_seen.update(blocks)
        for tenant in self._tenants_seen:
            self.tenant_kv.labels(tenant).set(blocks.get(tenant, 0))  # nothing in flight: holds nothing

    def update_links(self, links: dict) -> None:
        """`links`: the scheduler's LinkEstimate by "prefill->decode"; a link it forgot stops being exported."""
        for gauge in (self.link_bandwidth, self.link_latency):
            gauge.clear()
        for name, est in links.items():
            self.link_latency.labels(name).set(est.latency_s)
            if est.bytes_per_s is not None:
                self.link_bandwidth.labels(name).set(est.bytes_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
