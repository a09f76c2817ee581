"""What `engine.step_budget_ms` does to one colocated engine (prefill and decode in one engine, in this
process, no Ray), with and without the budget, same model and load:

- mixed: `--decodes` requests decoding when a `--long`-token prompt arrives; the seconds of every step that
  carries decodes until the long prompt's first token (those are the decodes' inter-token gaps), and that
  first token's wait.
- load: `--clients` requests in flight at all times (a new one when one ends), or with `--rate` Poisson
  arrivals (open loop, TTFT from when each was due); `--requests` in all, random `--prompt`-token prompts
  and out/2 to 3 out/2 tokens each (ignore_eos; varied, so requests end apart and new prompts meet running
  decodes); TPOT p50 (per request: (last token - first) / (tokens - 1)) and TTFT p50.

Prints one line per point and the ratios budget / none. Timing on a shared machine is noisy: compare runs of
one invocation only.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.default_model import resolve_model
from actors.protocol.sampling_params import SamplingParams


def _engine(model: str, budget_ms: float | None) -> Engine:
    return Engine(EngineConfig(model=model, step_budget_ms=budget_ms, tenant_slowdown=None, num_kv_blocks=2048))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab // 8, vocab) for _ in range(n)]


def _warm(engine: Engine, rng: random.Random) -> None:
    """Measure the step cost at a few sizes (and warm the kernels) before anything is timed."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    vocab = engine.vocab_size
    engine.generate([_prompt(rng, 256, vocab)] + [_prompt(rng, 32, vocab) for _ in range(8)], params)


def mixed(engine: Engine, decodes: int, long: int, seed: int) -> dict:
    rng = random.Random(seed)
    _warm(engine, rng)
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    for i in range(decodes):
        engine.add_request(f"d{i}", _prompt(rng, 128, engine.vocab_size), params)
    while engine.batcher.queued_prefill_tokens():
        engine.step()
    engine.step()  # every one decoding now
    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request("long", _prompt(rng, long, engine.vocab_size), first_only)
    added, steps, first = time.perf_counter(), [], None
    while first is None:
        start = time.perf_counter()
        outs = engine.step()
        took = time.perf_counter() - start
        if engine.last_step_shape.decode_seqs:
            steps.append(took)
        if any(o.request_id == "long" for o in outs):
            first = time.perf_counter() - added
    for i in range(decodes):
        engine.abort(f"d{i}")
    return {"steps": len(steps), "step_p50_ms": 1e3 * statistics.median(steps), "step_max_ms": 1e3 * max(steps),
            "long_ttft_s": first}


def load(engine: Engine, requests: int, prompt: int, out: int, seed: int, clients: int, rate: float | None) -> dict:
    """Closed loop (`clients` in flight) or, with `rate`, open loop (Poisson arrivals, timed from when each was
    due, as vLLM's client times them)."""
    rng = random.Random(seed)
    _warm(engine, rng)
    added: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    due = []  # open loop: when each request arrives
    started = 0
    t0 = time.perf_counter()
    if rate is not None:
        at = t0
        for _ in range(requests):
            at += rng.expovariate(rate)
            due.append(at)

    def add(when: float) -> None:
        nonlocal started
        rid = f"r{started}"
        started += 1
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(out // 2, out * 3 // 2), ignore_eos=True)
        engine.add_request(rid, _prompt(rng, prompt, engine.vocab_size), params)
        added[rid], times[rid] = when, []

    if rate is None:
        for _ in range(min(clients, requests)):
            add(time.perf_counter())
    while started < requests or engine.has_unfinished():
        if rate is not None:
            while started < requests and due[started] <= time.perf_counter():
                add(due[started])
            if not engine.has_unfinished():
                time.sleep(max(due[started] - time.perf_counter(), 0.0))  # idle until the next one is due
                continue
        for o in engine.step():
            now = time.perf_counter()
            times[o.request_id] += [now] * len(o.new_token_ids)
            if rate is None and o.finished and started < requests:
                add(now)
    ttft = [times[r][0] - added[r] for r in times]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {"requests": len(times), "tpot_p50_ms": 1e3 * statistics.median(tpot),
            "ttft_p50_s": statistics.median(ttft), "budgeted_steps": engine.batcher.budgeted_steps}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget-ms", default="100", help="step budgets to compare with none, comma-separated (ms)")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=4, help="closed loop: requests in flight")
    ap.add_argument("--rate", type=float, default=None, help="open loop instead: Poisson arrivals, requests/s")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", choices=("mixed", "loop"), default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    results = {}
    budgets = [float(b) for b in args.budget_ms.split(",")]
    for name, budget in [("none", None)] + [(f"{b:g}ms", b) for b in budgets]:
        engine = _engine(model, budget)
        if args.skip != "mixed":
            results[("mixed", name)] = r = mixed(engine, args.decodes, args.long, args.seed)
            print(f"mixed {name:6} {args.decodes} decodes + {args.long}-token prompt: steps with decodes {r['steps']}, "
                  f"p50 {r['step_p50_ms']:.0f} ms, max {r['step_max_ms']:.0f} ms; long prompt's first token "
                  f"{r['long_ttft_s']:.2f} s", flush=True)
        if args.skip != "loop":
            engine = _engine(model, budget)
            results[("loop", name)] = r = load(engine, args.requests, args.prompt, args.out, args.seed, args.clients,
                                               args.rate)
            how = f"{args.clients} clients" if args.rate is None else f"{args.rate:g} req/s"
            print(f"loop  {name:6} {how} x {args.prompt} in / {args.out} out, {r['requests']} requests: "
                  f"TPOT p50 {r['tpot_p50_ms']:.0f} ms, TTFT p50 {r['ttft_p50_s']:.2f} s, budget cut "
                  f"{r['budgeted_steps']} steps", flush=True)
    for budget in budgets:
        name = f"{budget:g}ms"
        if ("mixed", name) in results:
            a, b = results[("mixed", name)], results[("mixed", "none")]
            print(f"mixed {name}/none: step max {a['step_max_ms'] / b['step_max_ms']:.2f}x, step p50 "
                  f"{a['step_p50_ms'] / b['step_p50_ms']:.2f}x, long prompt's first token "
                  f"{a['long_ttft_s'] / b['long_ttft_s']:.2f}x")
        if ("loop", name) in results:
            a, b = results[("loop", name)], results[("loop", "none")]
            print(f"loop  {name}/none: TPOT p50 {a['tpot_p50_ms'] / b['tpot_p50_ms']:.2f}x, TTFT p50 "
                  f"{a['ttft_p50_s'] / b['ttft_p50_s']:.2f}x")


if __name__ == "__main__":
    main()
