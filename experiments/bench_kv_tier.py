"""Time to first token of a repeated long prefix with the host KV tier on and off (issue 55, first part).

One colocated worker with a KV pool that holds a prefix and little else. Each round: a prompt of `--prefix`
tokens (new text each round), fillers that push its blocks out of the pool, then the same prefix with a short
new turn, timed from submit to its first token. With the tier the evicted prefix is loaded from host memory;
without it, it is computed again. Both runs in one process (a cluster each, one after the other); printed,
never asserted: one run on a shared, noisy box.

    python -m experiments.bench_kv_tier [--model builtin:tiny-llama --prefix 1024 --rounds 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client

_BLOCK = 16


def config(model: str, prefix: int, host_bytes: int) -> TandemConfig:
    blocks = prefix // _BLOCK + 24  # the prefix, a turn, and not much more: a filler evicts it
    return TandemConfig.model_validate({
        "mode": "colocated", "model": {"path": model, "dtype": "float32"},
        "engine": {"block_size": _BLOCK, "num_kv_blocks": blocks, "max_num_batched_tokens": 4096},
        "colocated": {"replicas": 1, "num_cpus": 1}, "kv_tier": {"host_bytes": host_bytes},
        # A real model's long prompt on a busy CPU box can be predicted past the shipped bound and refused at
        # the door: here every prompt is to be served, however slowly.
        "scheduler": {"progress_timeout_s": 600},
    })


def ttft(client, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the first token, and the cached tokens the answer reported."""
    start = time.perf_counter()
    submitted = client.submit(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = None
    for event in client.events(submitted):
        if first is None and event.token_ids:
            first = time.perf_counter() - start
    return first, submitted.stream.results[0].num_cached_tokens


def run(model: str, prefix: int, rounds: int, host_bytes: int, seed: int) -> list[tuple[float, int]]:
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(5, 250) for _ in range(n)]  # noqa: E731 (any model's vocabulary has these)
    cluster = Cluster.start(config(model, prefix, host_bytes))
    out = []
    try:
        client = open_client(cluster)
        ttft(client, words(64))  # warm-up
        for _ in range(rounds):
            shared = words(prefix)
            ttft(client, shared + words(8))
            for _ in range(2):
                ttft(client, words(prefix))  # fillers: the shared prefix leaves the pool
            if cluster.tiers:
                time.sleep(0.5)  # the evicted blocks are written behind
            out.append(ttft(client, shared + words(8)))
        if cluster.tiers:
            print("tier:", cluster.check_integrity()["tiers"])
    finally:
        cluster.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:tiny-llama")
    parser.add_argument("--prefix", type=int, default=1024, help="tokens of the repeated prefix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--host-bytes", type=int, default=256 << 20)
    args = parser.parse_args()
    ray.init(namespace="tandem", include_dashboard=False, log_to_driver=False)
    results = {}
    for name, host_bytes in (("tier on", args.host_bytes), ("tier off", 0)):
        results[name] = run(args.model, args.prefix, args.rounds, host_bytes, seed=1)
        times = [t for t, _ in results[name]]
        print(f"{name}: TTFT median {statistics.median(times) * 1e3:.1f} ms over {len(times)} rounds "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times)}); cached tokens {[c for _, c in results[name]]}")
    on = statistics.median(t for t, _ in results["tier on"])
    off = statistics.median(t for t, _ in results["tier off"])
    print(f"TTFT off / on: {off / on:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
