"""Issue 52, finding 5 at full size: many loopback addresses hold as many idle connections as they can
(reconnecting whenever the ingress closes one) while a separate process times an innocent client's
streamed first token. Prints the innocent TTFT before and during the flood, their ratio, and the ingress's
open files and RSS (`--pid`).

    tandem serve --config configs/local.yaml &
    python -m experiments.bench_connection_flood --url http://127.0.0.1:8000 --pid <ingress pid>

The ingress process is the one holding the port: `ss -ltnp 'sport = :8000'` names it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from urllib.parse import urlparse

PROBE = r"""
import json, sys, time, httpx
url, seconds, model = sys.argv[1], float(sys.argv[2]), sys.argv[3]
ttfts, errors, end = [], [], time.monotonic() + seconds
while time.monotonic() < end:
    start = time.perf_counter()
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={"model": model, "prompt": "hello",
                "max_tokens": 4, "temperature": 0, "stream": True}) as r:
            first = None
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
            if first is None:
                raise RuntimeError(f"no token (HTTP {r.status_code})")
            ttfts.append(first)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}"[:120])
    time.sleep(0.2)
print(json.dumps({"ttfts": ttfts, "errors": errors}))
"""


def probe(url: str, seconds: float) -> dict:
    """An innocent client in its own process (the flood's event loop must not delay what it measures)."""
    out = subprocess.run([sys.executable, "-c", PROBE, url, str(seconds), model_name(url)], capture_output=True, text=True, check=True,
                         timeout=seconds + 120)
    return json.loads(out.stdout)


def model_name(url: str) -> str:
    import httpx
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


async def hold(host: str, port: int, source: str, count: int, held: list[int], stop: asyncio.Event) -> None:
    """Keep `count` idle connections from `source` open, opening a new one whenever one is closed."""
    async def one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.5)
                continue
            held[0] += 1
            try:
                await reader.read(1)  # silent: returns when the ingress closes it
            except OSError:
                pass
            finally:
                held[0] -= 1
                writer.close()
    await asyncio.gather(*(one() for _ in range(count)))


async def flood(url: str, addresses: int, per_address: int, seconds: float, pid: int | None) -> dict:
    parsed = urlparse(url)
    held, stop = [0], asyncio.Event()
    tasks = [asyncio.create_task(hold(parsed.hostname, parsed.port, f"127.0.{1 + a // 250}.{1 + a % 250}",
                                      per_address, held, stop)) for a in range(addresses)]
    await asyncio.sleep(20)  # the flood fills
    samples = []
    during = asyncio.create_task(asyncio.to_thread(probe, url, seconds))
    while not during.done():
        samples.append({"held": held[0], **ingress_files(pid)})
        await asyncio.sleep(2)
    stop.set()
    for t in tasks:
        t.cancel()
    return {"probe": during.result(), "samples": samples}


def ingress_files(pid: int | None) -> dict:
    if pid is None:
        return {}
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return {"ingress_fds": len(os.listdir(f"/proc/{pid}/fd")), "ingress_rss_mb": rss // 1024}


def p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--addresses", type=int, default=18)
    ap.add_argument("--per-address", type=int, default=850, help="connections each address tries to hold")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--pid", type=int, help="the ingress's process id: its open files and RSS are sampled")
    args = ap.parse_args()
    before = probe(args.url, args.seconds / 2)
    files_before = ingress_files(args.pid)
    during = asyncio.run(flood(args.url, args.addresses, args.per_address, args.seconds, args.pid))
    quiet, loud = before["ttfts"], during["probe"]["ttfts"]
    most_held = max((s["held"] for s in during["samples"]), default=0)
    print(json.dumps({"before": files_before, "samples": during["samples"]}, indent=1))
    print(f"flood: {args.addresses} addresses x {args.per_address} tries, at most {most_held} connections held at once")
    print(f"innocent TTFT p50 {statistics.median(quiet) * 1e3:.0f} ms unloaded -> "
          f"{statistics.median(loud) * 1e3:.0f} ms in the flood ({statistics.median(loud) / statistics.median(quiet):.2f}x); "
          f"p95 {p(quiet, .95) * 1e3:.0f} -> {p(loud, .95) * 1e3:.0f} ms; "
          f"{len(loud)} answered, {len(during['probe']['errors'])} failed")
    for error in sorted(set(during["probe"]["errors"]))[:5]:
        print("  failed:", error)


if __name__ == "__main__":
    main()
