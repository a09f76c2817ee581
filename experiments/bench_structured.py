"""`tandem bench structured`: what structured output costs the engine. The same batch of greedy requests
runs unconstrained and then each under a JSON schema; it reports the grammar mask's time per step (filling
every row's bitmask and applying it) as a share of the step, and the throughput ratio; and how long a spec
past the size limits takes to be refused, against one compile of the schema. Measured in this run; the
ratios, not the absolute rates, are the claim.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.default_model import SMOLLM2_MODEL, ensure_default_model, resolve_model
from actors.protocol.sampling_params import SamplingParams
from actors.engine.structured import GrammarError, Grammars
from actors.protocol.structured_output import MAX_ALTERNATIVES, MAX_DEPTH, MAX_SPEC_BYTES, StructuredOutput
from experiments.bench_report import add_out_argument, report_main

# Bounded everywhere, so even a random model's output completes and every request runs the same course.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Step the engine to the end of the batch; the mask's own time comes from the engine's grammars."""
    grammars = engine.sampler.grammars
    mask_s0 = grammars.mask_s if grammars else 0.0
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    steps, tokens, lengths, start = 0, 0, dict.fromkeys(ids, 0), time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            lengths[out.request_id] += len(out.new_token_ids)
            tokens += len(out.new_token_ids)
        steps += 1
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    grammars = engine.sampler.grammars
    mask_s = (grammars.mask_s - mask_s0) if grammars else 0.0
    return {"elapsed_s": elapsed, "steps": steps, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed,
            "step_ms": 1000 * elapsed / steps, "mask_ms_per_step": 1000 * mask_s / steps,
            "mask_share_of_step": mask_s / elapsed, "lengths": list(lengths.values())}


def past_the_limits() -> list[StructuredOutput]:
    """Specs the size limits refuse (the kinds of the issue that once stalled every worker)."""
    return [StructuredOutput("choice", json.dumps([f"option {i}" for i in range(50_000)])),
            StructuredOutput("json_schema", json.dumps({"enum": [f"v{i}" for i in range(MAX_ALTERNATIVES + 1)]})),
            StructuredOutput("json_schema", "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5)),
            StructuredOutput("regex", "a" * (MAX_SPEC_BYTES + 1))]


def _refusals(engine: Engine, spec: StructuredOutput) -> dict:
    """How long a refusal of a spec past the limits takes, against a compile of the bench's schema in a fresh
    compiler (the tests check that a refusal begins no compile; this is how fast it is)."""
    grammars = Grammars(engine.tokenizer, engine.vocab_size)
    start = time.perf_counter()
    grammars.compile(spec)
    compile_s = time.perf_counter() - start
    refuse_s = []
    for big in past_the_limits():
        start = time.perf_counter()
        try:
            grammars.compile(big)
        except GrammarError:
            refuse_s.append(time.perf_counter() - start)
    assert len(refuse_s) == len(past_the_limits()) and grammars.compiles_begun == 1, "a spec past the limits compiled"
    return {"compile_ms": 1000 * compile_s, "refuse_ms_max": 1000 * max(refuse_s),
            "refuse_vs_compile": max(refuse_s) / compile_s}


def bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    model_dir = Path(resolve_model(SMOLLM2_MODEL)) if args.model == "smollm2" else ensure_default_model()
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=4096, block_size=16, max_num_seqs=args.batch))
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    structured = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_output=spec)
    _run(engine, prompts[:1], [structured])  # compiles the grammar and warms the paths up
    constrained = _run(engine, prompts, [structured] * len(prompts))
    # Unconstrained, each request produces exactly as many tokens as it did under the schema: the same
    # batch shapes step by step. Run before and after, to see the machine's drift.
    free_params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in constrained.pop("lengths")]
    before, after = _run(engine, prompts, free_params), _run(engine, prompts, free_params)
    free = {k: (before[k] + after[k]) / 2 for k in before if k != "lengths"}
    free["drift"] = after["output_tokens_per_s"] / before["output_tokens_per_s"]
    constrained_again = _run(engine, prompts, [structured] * len(prompts))
    constrained_again.pop("lengths")
    constrained = {k: (constrained[k] + constrained_again[k]) / 2 for k in constrained}
    refusals = _refusals(engine, spec)
    report = {"model": args.model, "vocab_size": vocab, "batch": args.batch, "threads": torch.get_num_threads(),
              "unconstrained": free, "json_schema": constrained,
              "throughput_ratio": constrained["output_tokens_per_s"] / free["output_tokens_per_s"],
              "refusals": refusals}
    print(f"a spec past the limits is refused in {refusals['refuse_ms_max']:.1f} ms at most: "
          f"{refusals['refuse_vs_compile']:.2f}x the {refusals['compile_ms']:.0f} ms compile of the bench's schema")
    print(f"{args.model} (vocab {vocab}), batch {args.batch}: mask {constrained['mask_ms_per_step']:.3f} ms per step "
          f"= {constrained['mask_share_of_step']:.1%} of a {constrained['step_ms']:.2f} ms step; throughput "
          f"{report['throughput_ratio']:.2f}x unconstrained ({free['step_ms']:.2f} ms per step; the machine drifted "
          f"{free['drift']:.2f}x between the two unconstrained runs)")
    return report


def summarize(report: dict) -> str:
    c = report["json_schema"]
    return (f"{report['model']} batch {report['batch']}: grammar mask {c['mask_ms_per_step']:.3f} ms/step "
            f"({c['mask_share_of_step']:.1%} of the step), throughput {report['throughput_ratio']:.2f}x unconstrained")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["default", "smollm2"], default="default",
                   help="default: the tiny random model (vocabulary 2048); smollm2: SmolLM2-135M (49152)")
    p.add_argument("--batch", type=int, default=32, help="requests decoded together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=200, help="a cap; the schema ends each output before it")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_out_argument(p, "structured")
    p.set_defaults(func=report_main("structured", bench, summarize), smoke={"batch": 4, "threads": 1})
