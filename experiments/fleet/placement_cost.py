"""The cost of one placement decision vs the number of workers, in-process (no Ray, no load): the
scheduler's own routing code with N registered workers whose reports fill the prefix index and the
link costs as a running fleet's would.

    python -m experiments.fleet.placement_cost [--workers 64,256,512] [--decisions 2000]

Prints microseconds per decision at each N and the ratio to the smallest N: what routing alone costs
as the fleet grows, apart from Ray and the event loop (`tandem bench control-plane` measures those).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from actors.engine.kv.block_hash import hash_prompt_blocks
from actors.protocol.kv_events import BlockStored
from actors.protocol.messages import GenerateRequest, KvRankEndpoint, TransferSample, WorkerInfo, WorkerStats
from actors.protocol.sampling_params import SamplingParams
from cluster.control.scheduler.link_costs import LinkCosts
from cluster.control.scheduler.placement import Placer
from cluster.control.scheduler.prefix_index import PrefixIndex
from cluster.control.scheduler.registry import WorkerRegistry
from cluster.control.scheduler.request_table import RequestTable
from cluster.control.scheduler.scheduler_state import SchedulerSettings
from cluster.control.scheduler.ttft_guard import TtftGuard

# Self-contained (it imports only what the scheduler has had since the redesign), so the same file
# measures an older checkout too: the before/after of a change to routing.
_BLOCK = 16
_MODEL = "sim"
_SETTINGS = SchedulerSettings(
    mode="disaggregated", routing="cache_aware", block_size=_BLOCK, model_id=_MODEL,
    reserve="prompt_plus_max_tokens", max_queued=1_000_000, queue_timeout_s=5.0, local_prefill=False,
    local_prefill_penalty=1.0, prefill_s_per_token=1e-5, transfer_bytes_per_s=10e9)


class _Unwatched:
    """A stand-in actor handle: the registry's process watch waits on it forever."""

    def __getattr__(self, name):
        return self

    def remote(self, *args):
        return asyncio.get_running_loop().create_future()


def _stats(wid: str, role: str, rng: random.Random) -> WorkerStats:
    return WorkerStats(wid, role, 2000, 4096, 2096, rng.randrange(40), rng.randrange(5), rng.randrange(20000),
                       0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.02, 2.5e-6)


async def _cost(num_workers: int, decisions: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    settings = _SETTINGS
    registry = WorkerRegistry(settings.heartbeat_timeout_s, settings.progress_timeout_s, lambda wid, why: None)
    table, index = RequestTable(), PrefixIndex()
    links = LinkCosts(settings.transfer_bytes_per_s)
    placer = Placer(settings, registry, table, index, TtftGuard(None), links)
    registry.on_change = table.on_change = placer.refresh
    roles = {f"w{i}": ("prefill" if i % 2 == 0 else "decode") for i in range(num_workers)}
    for wid, role in roles.items():
        endpoints = (KvRankEndpoint("tcp://127.0.0.1:1", 0, 1, 1),) if role == "decode" else ()
        registry.add(WorkerInfo(wid, role, endpoints, 4096, _BLOCK, 4096, "inc"), _Unwatched())
        registry.observe(_stats(wid, role, rng))
    # 16 system prompts of 448 tokens, each with user turns of 64: as `tandem bench control-plane` sends.
    systems = [[rng.randrange(32000) for _ in range(448)] for _ in range(16)]
    prompts = [rng.choice(systems) + [rng.randrange(32000) for _ in range(64)] for _ in range(256)]
    # Every worker caches some of the traffic's prefixes; every link has been measured.
    for wid in roles:
        for p in rng.sample(prompts, 8):
            hashes = hash_prompt_blocks(p, _BLOCK, None, _MODEL)
            index.apply(wid, [BlockStored(h, hashes[i - 1] if i else None, _BLOCK) for i, h in enumerate(hashes)])
    prefill = [w for w, r in roles.items() if r == "prefill"]
    for decode in (w for w, r in roles.items() if r == "decode"):
        sources = rng.sample(prefill, min(8, len(prefill)))
        links.observe(decode, tuple(TransferSample(p, 2 << 20, 0.001) for p in sources))
    requests = [(prompts[i % len(prompts)], hash_prompt_blocks(prompts[i % len(prompts)], _BLOCK, None, _MODEL))
                for i in range(decisions)]
    params = SamplingParams(max_tokens=4)
    start = time.perf_counter()
    for i, (p, hashes) in enumerate(requests):
        request = GenerateRequest(f"r{i}", p, params, "tcp://127.0.0.1:2")
        placed = placer.place(request, hashes, placer.blocks_needed(request), time.monotonic())
        assert placed is not None and not hasattr(placed, "reason"), placed
    return (time.perf_counter() - start) / decisions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="16,64,256,512")
    parser.add_argument("--decisions", type=int, default=2000)
    args = parser.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    costs = {n: asyncio.run(_cost(n, args.decisions)) for n in sizes}
    base = costs[sizes[0]]
    for n, c in costs.items():
        print(f"{n:4d} workers: {c * 1e6:8.1f} us per placement ({c / base:.2f}x {sizes[0]} workers)")


if __name__ == "__main__":
    main()
