"""Overload: open-loop arrivals at 3x capacity for 30 s against `tandem serve` with load shedding on.

The unloaded TTFT and the capacity are measured first, on the same layout with the default shedding. Under
3x that load the admitted requests keep meeting a TTFT SLO set from the unloaded TTFT, the rest get
429 with Retry-After, and the memory of the server and of its workers stays bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from experiments.bench_engine import ensure_bench_model

pytestmark = pytest.mark.slow
PROMPT_LEN, OUTPUT_LEN, DURATION_S = 384, 8, 30.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(tmp_path: Path, max_predicted_ttft_s: float | None):
    config = yaml.safe_load((Path(__file__).parents[3] / "configs" / "local.yaml").read_text())
    config["model"]["path"] = str(ensure_bench_model())
    config["engine"]["num_kv_blocks"] = 1024
    # A latency-minded token budget per step (a step is the granularity of every TTFT).
    config["engine"]["max_num_batched_tokens"] = 512
    config["scheduler"]["max_predicted_ttft_s"] = max_predicted_ttft_s
    config["scheduler"]["local_prefill"] = False
    path = tmp_path / f"overload-{max_predicted_ttft_s}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = _free_port()
    log = open(tmp_path / f"serve-{port}.log", "w")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--config", str(path), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()
            assert time.monotonic() < deadline, "tandem serve did not become ready"
            time.sleep(0.5)
        yield base, proc.pid
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(PROMPT_LEN)]


async def _one(client: httpx.AsyncClient, base: str, prompt: list[int], scheduled: float) -> dict:
    """One streamed request; TTFT from its scheduled arrival (no coordinated omission)."""
    await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
    body = {"model": "bench-llama-56m", "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            body = await resp.aread()
            return {"status": resp.status_code, "retry_after": resp.headers.get("retry-after"),
                    "message": json.loads(body)["error"]["message"]}
        ttft = None
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"] is not None:
                    ttft = time.perf_counter() - scheduled
        return {"status": 200, "ttft": ttft, "done": time.perf_counter() - scheduled}


async def _drive(base: str, arrivals: list[float], rng: random.Random) -> list[dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.perf_counter() + 0.2
        return await asyncio.gather(*[_one(client, base, _prompt(rng), start + t) for t in arrivals])


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker_rss(base: str) -> dict[str, int]:
    # /metrics carries the workers' stats; the scheduler state is not exposed over HTTP, so read the gauge.
    text = httpx.get(base + "/metrics", timeout=10).text
    return {line.split('worker="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("tandem:worker_rss_bytes{")}


def test_overload_sheds_with_429_and_keeps_the_ttft_slo(tmp_path):
    rng = random.Random(0)
    # 1. Unloaded TTFT and capacity, shedding only past half the progress bound (the default).
    with serving(tmp_path, None) as (base, _):
        asyncio.run(_drive(base, [0.0], rng))  # warm-up
        unloaded = [asyncio.run(_drive(base, [0.0], rng))[0]["ttft"] for _ in range(5)]
        burst = asyncio.run(_drive(base, [0.0] * 16, rng))
    ttft0 = statistics.median(unloaded)
    capacity = 16 / max(r["done"] for r in burst)  # requests/s with the prefill pool saturated
    slo = 5 * ttft0
    rate = 3 * capacity

    # 2. The same layout with shedding, at 3x capacity, open loop (Poisson) for 30 s.
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < DURATION_S:
        arrivals.append(t)
    with serving(tmp_path, slo / 2.5) as (base, pid):  # shed with a margin: predictions are estimates
        asyncio.run(_drive(base, [0.0, 0.0], rng))  # warm-up: the workers measure their prefill cost
        rss_before, workers_before = _rss(pid), _worker_rss(base)
        results = asyncio.run(_drive(base, arrivals, rng))
        rss_after, workers_after = _rss(pid), _worker_rss(base)

    admitted = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    ttfts = sorted(r["ttft"] for r in admitted)
    met = sum(t <= slo for t in ttfts) / len(ttfts)
    report = {
        "unloaded_ttft_s": ttft0, "capacity_rps": capacity, "offered_rps": rate, "slo_ttft_s": slo,
        "sent": len(results), "admitted": len(admitted), "shed_429": len(shed),
        "admitted_ttft_p50_s": ttfts[len(ttfts) // 2], "admitted_ttft_p90_s": ttfts[int(len(ttfts) * 0.9)],
        "admitted_meeting_slo": met, "ingress_rss_growth_mb": (rss_after - rss_before) / 2**20,
        "worker_rss_growth_mb": {w: (workers_after[w] - workers_before[w]) / 2**20 for w in workers_after},
        "shed_examples": sorted({r["message"] for r in shed})[:3],
    }
    print(json.dumps(report, indent=1))
    assert len(admitted) + len(shed) == len(results), [r for r in results if r["status"] not in (200, 429)]
    assert shed and all(r["retry_after"] and int(r["retry_after"]) >= 1 for r in shed)
    assert len(admitted) >= 0.2 * len(results) / 3  # it keeps serving a good share of its capacity
    assert met >= 0.9, report
    assert rss_after - rss_before < 300 * 2**20, report
    assert workers_after and all(workers_after[w] - workers_before[w] < 300 * 2**20 for w in workers_after), report
