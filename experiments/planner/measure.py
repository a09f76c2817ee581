"""`tandem plan profile`: time real engine steps on this machine and fit a linear cost profile.

The engine runs with the cluster's token budget (max_num_batched_tokens), so the profile times the
shapes the workers run. Prefill samples: k prompts of n random tokens (max_tokens=1, prefix caching
off) computed in one `Engine.step`, for the (k, n) of a grid that fit the budget; and chunked prompts
longer than the budget, each chunk timed as its own sample (a full budget of tokens after 0, 1, 2...
budgets already computed, and a shorter last chunk): a long prompt's later chunks attend to a longer
context, which is what separates the per-token from the quadratic attention cost on the cluster.
Decode samples: b requests adopted with c tokens of context (`Engine.reserve` + `adopt`, the decode
worker's own path, so no prefill is paid to set them up), then single steps timed, for a grid of (b, c).
Each sample is the median of a few repeats. The fits are non-negative least squares on relative error
(small decode steps matter as much as long prefills). The torch thread count should be the workers'
(`torch_threads` in the pool config, 1 by default), since that is what the cluster will run with.
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from cluster.control.autoscale.profile import BatchShape, EngineLimits, EngineProfile, LinearCost, ModelShape, chunk_pairs
from cluster.control.autoscale.fit import fit_nonnegative
from experiments.planner.transfer_probe import measure_transfer

PREFILL_GRID = [(1, 16), (1, 64), (1, 256), (1, 512), (1, 1024), (4, 32), (4, 128), (8, 64), (2, 512)]
DECODE_GRID = [(b, c) for c in (32, 512) for b in (1, 4, 16, 64)]
CHUNKED_PROMPTS = (4.0, 2.5)  # prompt lengths, in token budgets, timed chunk by chunk


def _prompts(g: torch.Generator, vocab: int, k: int, n: int) -> list[list[int]]:
    return torch.randint(10, vocab, (k, n), generator=g).tolist()


def _time_prefill(engine: Engine, g: torch.Generator, k: int, n: int, repeats: int) -> float:
    times = []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for rep in range(repeats):
        for i, prompt in enumerate(_prompts(g, engine.vocab_size, k, n)):
            engine.add_request(f"p{k}x{n}-{rep}-{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        if engine.last_step_tokens != k * n or engine.has_unfinished():
            raise RuntimeError(f"prefill sample {k}x{n} did not run as one step ({engine.last_step_tokens} tokens)")
    return statistics.median(times)


def _time_chunks(engine: Engine, g: torch.Generator, n: int, repeats: int) -> list[dict]:
    """Prefill one n-token prompt in budget-sized chunks; one sample per chunk, the median of repeats."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[tuple[int, int], list[float]] = {}
    for rep in range(repeats):
        engine.add_request(f"c{n}-{rep}", _prompts(g, engine.vocab_size, 1, n)[0], params)
        done = 0
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times.setdefault((engine.last_step_tokens, done), []).append(time.perf_counter() - start)
            done += engine.last_step_tokens
        if done != n:
            raise RuntimeError(f"chunked sample of {n} tokens computed {done}")
    return [{"kind": "prefill", "prompts": 1, "tokens": k, "context": c, "pairs": chunk_pairs(k, c),
             "s": statistics.median(t)} for (k, c), t in sorted(times.items(), key=lambda kv: kv[0][1])]


def _time_decode(engine: Engine, g: torch.Generator, b: int, c: int, steps: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = [f"d{b}x{c}-{i}" for i in range(b)]
    for rid, prompt in zip(ids, _prompts(g, engine.vocab_size, b, c)):
        if engine.reserve(rid, c) is None:
            raise ValueError(f"decode sample {b} x {c} tokens does not fit the KV cache: raise --num-kv-blocks")
        engine.adopt(rid, prompt, prompt[-1], params)
    engine.step()  # admits the batch
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        # A step that could not grow every sequence's KV computes fewer tokens (or none) and would
        # enter the fit as a nearly free decode step.
        if engine.last_step_tokens != b:
            raise RuntimeError(f"decode sample {b} x {c} ran {engine.last_step_tokens} tokens in a step, not {b}")
    for rid in ids:
        engine.abort(rid)
    return statistics.median(times)


def sample_shape(s: dict) -> BatchShape:
    if s["kind"] == "prefill":
        return BatchShape(s["tokens"], s["pairs"], s["prompts"])
    return BatchShape(decode_seqs=s["seqs"], decode_context=s["context"])


def fit_table(samples: list[dict], cost: LinearCost) -> str:
    """Each timed step next to the fitted cost of its shape: where the linear model misses."""
    lines = [f"  {'step':<34}{'measured ms':>12}{'fitted ms':>11}{'error':>8}"]
    for s in samples:
        if s["kind"] == "prefill":
            what = f"prefill {s['prompts']} x {s['tokens'] // s['prompts']} tok after {s.get('context', 0)}"
        else:
            what = f"decode {s['seqs']} seqs, {s['context']} ctx"
        fitted = cost.step_s(sample_shape(s), None)
        lines.append(f"  {what:<34}{s['s'] * 1e3:>12.1f}{fitted * 1e3:>11.1f}{(fitted - s['s']) / s['s']:>+8.1%}")
    return "\n".join(lines)


def profile_engine(model_dir: str, dtype: str = "float32", threads: int = 1, limits: EngineLimits = EngineLimits(),
                   repeats: int = 5, decode_steps: int = 5, measure_link: bool = True,
                   transfer_bytes_per_s: float = 2e9, transfer_latency_s: float = 0.0, log=print) -> EngineProfile:
    torch.set_num_threads(threads)
    engine = Engine(EngineConfig(model=model_dir, dtype=dtype, block_size=limits.block_size,
                                 num_kv_blocks=limits.num_kv_blocks, max_num_seqs=limits.max_num_seqs,
                                 max_num_batched_tokens=limits.max_num_batched_tokens,
                                 enable_prefix_caching=False, detokenize=False))
    g = torch.Generator().manual_seed(0)
    max_len = engine.max_model_len - decode_steps - 8
    engine.generate([[11] * 32], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    samples = []
    budget = limits.max_num_batched_tokens
    for k, n in PREFILL_GRID:
        if k * n <= budget and n < max_len:
            t = _time_prefill(engine, g, k, n, repeats)
            samples.append({"kind": "prefill", "prompts": k, "tokens": k * n, "pairs": k * chunk_pairs(n, 0), "s": t})
    for n in sorted({min(max_len, int(m * budget)) for m in CHUNKED_PROMPTS}):
        if n > budget:
            samples += _time_chunks(engine, g, n, repeats)
    log(f"  prefill: {len(samples)} samples, largest {max(s['tokens'] for s in samples)} tokens in a step, "
        f"longest context {max(s.get('context', 0) + s['tokens'] for s in samples)}")
    for b, c in DECODE_GRID:
        blocks = b * -(-(c + decode_steps + 5) // limits.block_size)
        if b <= limits.max_num_seqs and c < max_len and blocks <= limits.num_kv_blocks:
            t = _time_decode(engine, g, b, c, decode_steps)
            samples.append({"kind": "decode", "seqs": b, "context": b * (c + 1), "s": t})
    log(f"  decode: {sum(s['kind'] == 'decode' for s in samples)} samples")
    pre = [s for s in samples if s["kind"] == "prefill"]
    dec = [s for s in samples if s["kind"] == "decode"]
    p = fit_nonnegative(np.array([[1, s["tokens"], s["pairs"]] for s in pre], float), np.array([s["s"] for s in pre]))
    d = fit_nonnegative(np.array([[1, s["seqs"], s["context"]] for s in dec], float), np.array([s["s"] for s in dec]))
    cfg = engine.model_config
    model = ModelShape(name=model_dir.rstrip("/").rsplit("/", 1)[-1], num_layers=cfg.num_layers,
                       hidden_size=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                       dtype_bytes=engine.dtype.itemsize,
                       )
    if measure_link:
        transfer_bytes_per_s, transfer_latency_s = measure_transfer(engine.kv_caches)
        log(f"  KV transfer (zmq ipc, in-process): {transfer_bytes_per_s / 1e9:.2f} GB/s, "
            f"{transfer_latency_s * 1e3:.2f} ms latency")
    cost = LinearCost(*p, *d)
    log(fit_table(samples, cost))
    if budget < max_len:  # a held-out prompt the fit never saw, prefilled in chunks as a worker would
        n = min(max_len, budget * 2 - budget // 16)
        steps = _time_chunks(engine, g, n, 1)
        fitted = sum(cost.step_s(sample_shape(s), None) for s in steps)
        measured = sum(s["s"] for s in steps)
        log(f"  held-out {n}-token prompt in {len(steps)} chunks: measured {measured * 1e3:.0f} ms, "
            f"fitted {fitted * 1e3:.0f} ms ({(fitted - measured) / measured:+.1%})")
    hardware = f"{platform.processor() or platform.machine()}, {threads} torch thread(s), {dtype}"
    return EngineProfile("measured", hardware, model, LinearCost(*p, *d), limits,
                         transfer_bytes_per_s, transfer_latency_s, samples)
