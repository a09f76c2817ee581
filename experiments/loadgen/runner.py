"""Run one benchmark: send the workload on its schedule, collect a record per request, summarize.

Open loop: request i is sent at t0 + offset_i whether or not earlier ones finished, and its latency
counts from that scheduled time, so a stalled server cannot hide the wait it caused (no coordinated
omission). The client's own lateness (sent - scheduled) is reported, so a saturated client shows.
Closed loop keeps `concurrency` requests in flight; a request is "scheduled" when its slot frees,
which is exactly the omission open loop avoids, so results say which kind they are.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from experiments.loadgen.arrivals import open_loop_offsets, trace_offsets
from experiments.loadgen.http_client import RequestRecord, fetch_model, request_body, send_request
from experiments.loadgen.metrics import summarize
from experiments.loadgen.progress import Progress
from experiments.loadgen.spec import BenchSpec
from experiments.loadgen.workload import RequestSpec, TraceWorkload, Workload, build_workload


@dataclass
class BenchResult:
    spec: BenchSpec
    model: str
    records: list[RequestRecord]
    summary: dict  # see metrics.summarize

    def to_dict(self, with_requests: bool = True) -> dict:
        out = {"spec": self.spec.model_dump(mode="json"), "model": self.model, **self.summary}
        if with_requests:
            out["requests"] = [_record_dict(r) for r in self.records]
        return out

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path


def _record_dict(r: RequestRecord) -> dict:
    rounded = lambda x: None if x is None else round(x, 6)  # noqa: E731
    return {"index": r.index, "warmup": r.warmup, "prompt_len": r.prompt_len, "max_tokens": r.max_tokens,
            "scheduled_s": rounded(r.scheduled), "sent_s": rounded(r.sent), "end_s": rounded(r.end),
            "emits_s": [rounded(t) for t in r.emits], "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "cached_tokens": r.cached_tokens, "error": r.error, "error_detail": r.error_detail}


def run_benchmark(spec: BenchSpec) -> BenchResult:
    """Run `spec` to completion in a fresh event loop (from synchronous code)."""
    return asyncio.run(run_benchmark_async(spec))


async def run_benchmark_async(spec: BenchSpec) -> BenchResult:
    spec = spec.with_fixed_salt()
    workload = build_workload(spec.workload)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # No pool limit: a capped pool would queue sends inside the client, which is closed loop in disguise.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=spec.root_url, headers=headers, timeout=None, limits=limits) as client:
        model = spec.model or await fetch_model(client)
        if spec.arrival.kind == "closed":
            records = await _closed_loop(spec, workload, client, model)
        else:
            records = await _open_loop(spec, workload, client, model)
    return BenchResult(spec, model, records, summarize(records, spec))


def schedule(spec: BenchSpec, workload: Workload) -> list[float]:
    """Scheduled offsets of every request of an open-loop run, the warm-up ones first."""
    if spec.arrival.kind == "trace":
        assert isinstance(workload, TraceWorkload)
        count = spec.warmup + (spec.num_requests or workload.natural_count - spec.warmup)
        if count > workload.natural_count or count <= spec.warmup:
            raise ValueError(f"the trace holds {workload.natural_count} requests: warm-up ({spec.warmup}) plus "
                             f"measured ({count - spec.warmup}) must fit in it, with at least one measured")
        offsets = trace_offsets([r.timestamp for r in workload.requests], spec.arrival.rate)[:count]
        return offsets if spec.duration_s is None else _cut(offsets, spec)
    gen = open_loop_offsets(spec.arrival)
    offsets = list(itertools.islice(gen, spec.warmup))
    for i, t in enumerate(gen):
        if spec.num_requests is not None and i >= spec.num_requests:
            break
        if spec.duration_s is not None and i > 0 and t - offsets[spec.warmup] >= spec.duration_s:
            break
        offsets.append(t)
    return offsets


def _cut(offsets: list[float], spec: BenchSpec) -> list[float]:
    start = offsets[spec.warmup]
    return offsets[: spec.warmup] + [t for t in offsets[spec.warmup:] if t - start < spec.duration_s]


def _new_record(i: int, spec: BenchSpec, workload: Workload, scheduled: float) -> tuple[RequestRecord, RequestSpec]:
    req = workload.request(i)
    return RequestRecord(i, i < spec.warmup, req.prompt_len, req.output_len, scheduled), req


async def _open_loop(spec: BenchSpec, workload: Workload, client: httpx.AsyncClient, model: str) -> list[RequestRecord]:
    offsets = schedule(spec, workload)
    progress = Progress(len(offsets), spec.arrival.describe(), spec.progress)
    # Build every body before the clock starts, so the dispatch loop only sleeps and spawns.
    prepared = [_new_record(i, spec, workload, t) for i, t in enumerate(offsets)]
    bodies = [request_body(model, req, spec.temperature) for _, req in prepared]
    tasks = []
    t0 = time.perf_counter()
    for (record, _), body in zip(prepared, bodies):
        delay = t0 + record.scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_tracked(client, body, record, t0, spec, progress)))
    records = await asyncio.gather(*tasks)
    progress.close()
    return list(records)


async def _closed_loop(spec: BenchSpec, workload: Workload, client: httpx.AsyncClient, model: str) -> list[RequestRecord]:
    total = spec.warmup + spec.num_requests if spec.num_requests is not None else None
    progress = Progress(total, spec.arrival.describe(), spec.progress)
    counter = itertools.count()
    records: list[RequestRecord] = []
    measured_start: list[float] = []
    t0 = time.perf_counter()

    async def slot():
        while True:
            now = time.perf_counter() - t0
            if spec.duration_s is not None and measured_start and now - measured_start[0] >= spec.duration_s:
                return
            i = next(counter)
            if total is not None and i >= total:
                return
            if i == spec.warmup:
                measured_start.append(now)
            record, req = _new_record(i, spec, workload, now)
            records.append(record)
            await _tracked(client, request_body(model, req, spec.temperature), record, t0, spec, progress)

    await asyncio.gather(*(slot() for _ in range(spec.arrival.concurrency)))
    progress.close()
    return sorted(records, key=lambda r: r.index)


async def _tracked(client, body, record, t0, spec, progress) -> RequestRecord:
    progress.started()
    await send_request(client, body, record, t0, spec.request_timeout_s)
    progress.finished(record.ok)
    return record
