"""`tandem bench cluster`: what the cluster stack costs over the in-process engine.

- TPOT through a 1P+1D cluster / TPOT of the in-process engine on the same requests, at 1 and 16
  concurrent requests by default (`--concurrency`), with the same torch thread count per engine (the
  decode worker's).
- Time to first token at idle minus the prefill compute time of the same prompt.
All numbers come from one run; ratios compare within it.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import time
from pathlib import Path

import torch

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from experiments.bench_report import add_out_argument, report_main

_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def _tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def engine_tpot(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    times: dict[str, list[float]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"e{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            times.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
    return statistics.mean(_tpot(t) for t in times.values())


def cluster_tpot(cluster: Cluster, prompts: list[list[int]], params: SamplingParams) -> float:
    """Token arrival times at the client, read by one thread so the harness is not the bottleneck."""
    client = open_client(cluster)
    deltas: queue.Queue = queue.Queue()
    submitted = [client.submit(p, params, deltas=deltas) for p in prompts]
    times: dict[str, list[float]] = {s.request_id: [] for s in submitted}
    live = set(times)
    while live:
        delta = deltas.get(timeout=300)
        times[delta.attempt.request_id].extend([time.perf_counter()] * len(delta.token_ids))
        if delta.status.is_finished():
            live.discard(delta.attempt.request_id)
    return statistics.mean(_tpot(t) for t in times.values())


def idle_ttft_overhead(cluster: Cluster, engine: Engine, prompt: list[int], repeats: int = 5) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    client = open_client(cluster)
    ttfts, prefills = [], []
    for i in range(repeats):
        p = [prompt[0] + i + 1, *prompt[1:]]  # a fresh first block: no prefix-cache hit
        start = time.perf_counter()
        next(iter(client.stream(p, params)))
        ttfts.append(time.perf_counter() - start)
        engine.add_request(f"ttft-{i}", p, params)
        start = time.perf_counter()
        engine.step()
        prefills.append(time.perf_counter() - start)
        time.sleep(0.2)
    ttft, prefill = statistics.median(ttfts), statistics.median(prefills)
    return {"ttft_ms": 1e3 * ttft, "prefill_compute_ms": 1e3 * prefill, "overhead_ms": 1e3 * (ttft - prefill)}


def bench(args: argparse.Namespace) -> dict:
    config = TandemConfig.from_file(args.config)
    if args.model:
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": args.model})})
    torch.set_num_threads(config.decode.torch_threads)
    engine = Engine(config.engine_config(detokenize=False))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate([[11] * 8], SamplingParams(max_tokens=2))  # warm-up
    cluster = Cluster.start(config)
    report: dict = {"config": str(args.config), "model": config.model.path, "output_len": args.output_len, "tpot": {}}
    try:
        open_client(cluster).generate([[11] * 8], SamplingParams(max_tokens=2))  # warm-up
        for concurrency in args.concurrency:
            prompts = _prompts(concurrency, args.prompt_len, engine.vocab_size, seed=concurrency)
            ours = engine_tpot(engine, prompts, params)
            theirs = cluster_tpot(cluster, [[p[0] + 1, *p[1:]] for p in prompts], params)
            report["tpot"][str(concurrency)] = {"engine_ms": 1e3 * ours, "cluster_ms": 1e3 * theirs, "ratio": theirs / ours}
            print(f"concurrency {concurrency}: TPOT engine {1e3 * ours:.2f} ms, cluster {1e3 * theirs:.2f} ms, "
                  f"ratio {theirs / ours:.2f}")
        report["idle_ttft"] = idle_ttft_overhead(cluster, engine, _prompts(1, args.prompt_len, engine.vocab_size, 99)[0])
        t = report["idle_ttft"]
        print(f"idle TTFT {t['ttft_ms']:.1f} ms, prefill compute {t['prefill_compute_ms']:.1f} ms, "
              f"overhead {t['overhead_ms']:.1f} ms")
    finally:
        cluster.shutdown()
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(_CONFIG), help="a 1P+1D config (default: configs/local.yaml)")
    p.add_argument("--model", default=None, help="override the config's model path")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="concurrent requests per TPOT run")
    add_out_argument(p, "cluster")
    p.set_defaults(func=report_main("cluster", bench, summarize),
                   smoke={"prompt_len": 32, "output_len": 8, "concurrency": [1, 4]})


def summarize(report: dict) -> str:
    ratios = ", ".join(f"{t['ratio']:.2f} at {c} concurrent" for c, t in report["tpot"].items())
    return f"TPOT cluster/engine {ratios}; idle TTFT overhead {report['idle_ttft']['overhead_ms']:.1f} ms"
