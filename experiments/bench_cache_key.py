"""How much `prompt_cache_key` adds to the prefix-cache hit rate (issue 53, acceptance 3).

One 2P+2D cluster (configs/disagg-2p2d.yaml: the tiny model) behind the real HTTP ingress, hit by the official
`openai` client: many tenants (an API key each, so a cache salt each), each with several multi-turn chat
conversations that run at once; every turn resends the conversation so far (the tenant's system prompt, the
earlier turns, the model's answers) plus a new user message, as a chat app does. The same workload, on fresh
text, runs twice: without `prompt_cache_key`, then with one per conversation. Reported per run: the hit rate
(cached prompt tokens / prompt tokens, summed over the usage records of every answer; the ingress's
/metrics counters for the same run beside it), the same over turns after the first, and the ratio of the two
runs. One run each on a shared, noisy box: the numbers are printed, never asserted.

    python -m experiments.bench_cache_key [--tenants 8 --conversations 3 --turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from cluster.control.config import IngressSection, TandemConfig, TenantSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.http.server import make_server, served_model_name

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "disagg-2p2d.yaml"
_WORDS = ("alpha beta gamma delta kernel cache block token prefill decode worker tenant stream batch lease "
          "route shard queue page layer head model vector matrix tensor engine budget latency memory").split()


@dataclass
class Tally:
    """Usage summed over one run's answers."""

    prompt: int = 0
    cached: int = 0
    later_prompt: int = 0  # turns after the first: the ones a conversation's earlier turns can serve
    later_cached: int = 0
    requests: int = 0
    failures: list[str] = field(default_factory=list)

    def add(self, turn: int, usage) -> None:
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        self.prompt, self.cached, self.requests = self.prompt + usage.prompt_tokens, self.cached + cached, self.requests + 1
        if turn:
            self.later_prompt, self.later_cached = self.later_prompt + usage.prompt_tokens, self.later_cached + cached

    def rate(self) -> float:
        return self.cached / self.prompt if self.prompt else 0.0

    def later_rate(self) -> float:
        return self.later_cached / self.later_prompt if self.later_prompt else 0.0


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


async def _conversation(client: openai.AsyncOpenAI, model: str, system: str, key: str | None, args,
                        rng: random.Random, tally: Tally) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": _text(rng, args.user_words)})
        extra = {"prompt_cache_key": key} if key is not None else {}
        try:
            answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                          temperature=0.0, **extra)
        except openai.APIError as exc:
            tally.failures.append(f"{type(exc).__name__}: {exc}")
            return
        tally.add(turn, answer.usage)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        if args.think_s:
            await asyncio.sleep(rng.uniform(0, 2 * args.think_s))  # the user reads and types: an arrival process


async def _workload(url: str, model: str, args, seed: int, keyed: bool) -> Tally:
    """Every tenant's conversations at once, each one turn after another."""
    rng, tally = random.Random(seed), Tally()
    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key=f"key-{t}", max_retries=0, timeout=120)
               for t in range(args.tenants)]
    runs = []
    for t, client in enumerate(clients):
        system = _text(rng, args.system_words)  # the tenant's instructions, shared by its conversations
        for c in range(args.conversations):
            key = f"run{seed}-conversation-{c}" if keyed else None  # per tenant: the same name in two tenants is two keys
            runs.append(_conversation(client, model, system, key, args, random.Random(rng.random()), tally))
    try:
        await asyncio.gather(*runs)
    finally:
        for client in clients:
            await client.close()
    return tally


def _prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, served from the cache) on the ingress's /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total"):
            if line.startswith(name + " "):
                values[name] = float(line.split()[1])
    return values.get("tandem:prefix_cache_queries_total", 0.0), values.get("tandem:prefix_cache_hits_total", 0.0)


def _run(url: str, model: str, args, seed: int, keyed: bool) -> dict:
    queries0, hits0 = _prefix_counters(url)
    started = time.perf_counter()
    tally = asyncio.run(_workload(url, model, args, seed, keyed))
    seconds = time.perf_counter() - started
    queries, hits = _prefix_counters(url)
    return {"tally": tally, "seconds": seconds, "metrics_rate": (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0}


def bench(args) -> dict:
    config = TandemConfig.from_file(args.config)
    tenants = {f"key-{t}": TenantSection(tenant=f"tenant-{t}") for t in range(args.tenants)}
    ingress = IngressSection(api_keys=tenants, default_tokens_per_minute=None)
    cluster = Cluster.start(config)
    try:
        http = make_server(cluster, "127.0.0.1", 0, ingress)
        thread = threading.Thread(target=http.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not http.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start within 60 s")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
        try:
            model = served_model_name(cluster)
            warm = argparse.Namespace(**{**vars(args), "tenants": 2, "conversations": 2, "turns": 2})
            _run(url, model, warm, seed=0, keyed=False)  # the workers measure their prefill cost, links warm up
            without = _run(url, model, args, seed=1, keyed=False)
            with_key = _run(url, model, args, seed=2, keyed=True)
        finally:
            http.should_exit = True
            thread.join(timeout=30)
    finally:
        cluster.shutdown()
    return {"without": without, "with": with_key}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG), help="cluster layout (default: configs/disagg-2p2d.yaml)")
    p.add_argument("--tenants", type=int, default=8, help="tenants, an API key each")
    p.add_argument("--conversations", type=int, default=3, help="conversations per tenant, all at once")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--system-words", type=int, default=60, help="words in each tenant's system prompt")
    p.add_argument("--user-words", type=int, default=20, help="words in each user message")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens of each answer")
    p.add_argument("--think-s", type=float, default=0.0, help="mean pause between an answer and the next turn")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args()
    result = bench(args)
    for name in ("without", "with"):
        run = result[name]
        t: Tally = run["tally"]
        print(f"{name:>7} prompt_cache_key: hit rate {t.rate():.3f} ({t.cached}/{t.prompt} prompt tokens cached; "
              f"/metrics {run['metrics_rate']:.3f}), turns after the first {t.later_rate():.3f}; {t.requests} "
              f"answers in {run['seconds']:.1f} s, {len(t.failures)} failed {t.failures[:2]}")
    without, with_key = result["without"]["tally"], result["with"]["tally"]
    ratio = with_key.rate() / without.rate() if without.rate() else float("inf")
    later = with_key.later_rate() / without.later_rate() if without.later_rate() else float("inf")
    print(f"with / without: hit rate x{ratio:.2f}, turns after the first x{later:.2f} (one run each, shared box)")


if __name__ == "__main__":
    main()
