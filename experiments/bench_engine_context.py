"""`tandem bench engine --workloads context`: serving-shaped engine steps against the memory-bandwidth floor.

Points (every count and length times `--scale`; `--context-batches` / `--context-lens` pick a subset):
- decode: batch 1, 16 and 64, each sequence holding 512 or 2,048 tokens of context;
- mixed: 16 decodes at 512 tokens of context plus one fresh 512-token prompt computed in the same step
  (what a colocated worker's step looks like when a request arrives during decoding). If the engine
  cuts the prompt into smaller chunks, the first step (the one timed) is recorded with its real shape.

The context is a real prefill through the same engine, untimed: distinct random prompts, first computed
alone to their first token (`generate`, one output token) so that prefix caching holds them; then the
point's requests are seated on them (each recomputes only its last prompt token, so no sequence decodes
far past its context while others prefill) and stepped `WARMUP_STEPS` times. The 512-token prompts are the
prefixes of the 2,048-token ones: the largest batch's prompts are prefilled once for every point. Each
step is timed alone, `engine.step()` whole (schedule, forward, sample, post-process): `TIMED_STEPS` decode
steps, or for the mixed point `MIXED_REPS` reps (decodes seated afresh, a fresh prompt added, the step
that starts it timed); the headline is the median (the best is kept too). Each step's floor counts the
context it really attended to and the prompt tokens it really computed (the engine's `last_step_shape`).

With `--vllm-python`, vLLM's engine runs the same points on the same prompts (experiments/vllm_engine.py
`--steps`): its engine core in this process, `LLMEngine.step()` timed one by one the same way.

Floor of a step = (weight bytes + KV bytes it reads) / this machine's memory read rate, measured in the
same run as the best of a few read-only `torch.sum`s over a 1 GiB buffer (far larger than any LLC), on
the bench's torch threads. Weight bytes: every parameter once, except the embedding, of which only the
rows looked up are read; a tied LM head reads the whole matrix. KV bytes: the KV entries the step attends
to (a decode: its context and its own token; the mixed step's prompt: its own tokens, it has no cached
context) x layers x 2 (K and V) x KV heads x head dim x dtype size. Parameters are counted from the
checkpoint's tensors at the engine's dtype. The FLOP floor (the step's matmul
and attention FLOPs at the measured matmul rate) is recorded beside it: at large batches a CPU step can
be bound by compute instead.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.step_shape import StepShape
from actors.protocol.sampling_params import SamplingParams

CONTEXT_LENS = (512, 2048)
CONTEXT_BATCHES = (1, 16, 64)
MIXED = (16, 512, 512)  # decodes, their context, the fresh prompt's tokens (the engine may cut it in chunks)
WARMUP_STEPS = 2
TIMED_STEPS = 8
MIXED_REPS = 5
_READ_BUFFER_BYTES = 1 << 30
_BLOCK = 16
_BUDGET = 2048  # max_num_batched_tokens, as configs/default.yaml
_VLLM_TIMEOUT_S = 4 * 3600  # 64 x 2,048 prompt tokens prefilled on one core take tens of minutes
VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_engine.py"


@dataclass(frozen=True)
class StepPoint:
    batch: int  # sequences decoding
    context: int  # tokens of context each of them holds
    chunk: int = 0  # tokens of a fresh prompt computed in the same step (the mixed point)

    @property
    def name(self) -> str:
        return f"b{self.batch}x{self.context}" + (f"+p{self.chunk}" if self.chunk else "")


def make_points(scale: float = 1.0, batches=CONTEXT_BATCHES, lens=CONTEXT_LENS) -> list[StepPoint]:
    if min(*batches, *lens) < 1:
        raise ValueError(f"context batches {list(batches)} and lengths {list(lens)} must be positive")
    def n(x: int) -> int:
        return max(1, round(x * scale))

    points = list(dict.fromkeys(StepPoint(n(b), n(c)) for c in lens for b in batches))
    decodes, context, chunk = MIXED
    if context in lens:
        points.append(StepPoint(n(decodes), n(context), n(chunk)))
    return points


def bench_context(model_dir: Path, points: list[StepPoint], dtype: str, read_rate: float, flops_per_s: float,
                  vllm_python: str | None = None) -> dict:
    """Every point through tandem's engine (then vLLM's, where given) on the same prompts."""
    max_len = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    points = fit_context(points, max_len)
    engine = build_engine(model_dir, points, dtype)
    prompts, chunks = context_prompts(points, engine.vocab_size), chunk_prompts(points, engine.vocab_size)
    report = {"attention_backend": attention_backend(engine), "dtype": dtype, "kv_blocks": engine.num_kv_blocks,
              "points": run_points(engine, points, prompts, chunks, read_rate, flops_per_s)}
    kv_cache_bytes = engine.num_kv_blocks * engine.bytes_per_block
    del engine  # its KV cache (GBs at 64 x 2,048) is freed before vLLM allocates its own
    gc.collect()
    if vllm_python:
        vllm = run_vllm_points(vllm_python, model_dir, points, prompts, chunks, dtype, kv_cache_bytes)
        for name, theirs in vllm.pop("points").items():
            ours = report["points"][name]
            ours["vllm"] = theirs
            ours["vllm_step_s"] = theirs["step_s"]
            ours["ratio_vs_vllm"] = ours["step_s"] / theirs["step_s"]
            # vLLM's mixed step computes the whole prompt (exact says so); tandem's may have computed a chunk.
            ours["vllm_same_work"] = theirs["exact"] and ours["shape"]["prefill_tokens"] == ours["chunk"]
        report["vllm"] = vllm
    return report


# ---- the floor ----

def read_buffer_bytes(scale: float) -> int:
    """1 GiB; less below scale 1 (a quick check), never under 256 MiB (8x this box's 32 MiB LLC)."""
    return max(256 << 20, int(_READ_BUFFER_BYTES * min(1.0, scale)))


def memory_read_rate(nbytes: int = _READ_BUFFER_BYTES, trials: int = 5) -> float:
    """Bytes per second a read-only `torch.sum` streams from memory (the best of `trials`), on torch's
    current threads."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        buf.sum()
        best = max(best, buf.nbytes / (time.perf_counter() - start))
    return best


def copy_rate(nbytes: int = _READ_BUFFER_BYTES // 2, trials: int = 5) -> float:
    """Bytes read + written per second by a large tensor copy (recorded beside the read rate; not the floor's)."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.nbytes / (time.perf_counter() - start))
    return best


@dataclass(frozen=True)
class WeightCounts:
    """A checkpoint's parameters (element counts) by what a step reads of them. Counted from the files,
    not from the loaded model, whose linears may hold packed copies in place of their weights."""

    matmul: int  # 2-D weights but the embedding and the LM head: read whole
    other: int  # norms, biases: read whole
    head: int  # the LM head, read whole (with tied embeddings: the embedding matrix)
    hidden: int  # an embedding row's elements: only the rows looked up are read

    @classmethod
    def of_checkpoint(cls, model_dir: Path) -> WeightCounts:
        from safetensors import safe_open  # noqa: PLC0415

        shapes = {}
        for file in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})  # noqa: SIM118
        embed = next((n for n in shapes if n.endswith("embed_tokens.weight")), None)
        if embed is None:
            raise ValueError(f"{model_dir}: no embed_tokens.weight among its safetensors tensors")
        head = next((n for n in shapes if n.endswith("lm_head.weight")), embed)  # none: tied to the embedding
        counts = {n: math.prod(shape) for n, shape in shapes.items()}
        rest = [n for n in shapes if n not in (embed, head)]
        return cls(matmul=sum(counts[n] for n in rest if len(shapes[n]) == 2),
                   other=sum(counts[n] for n in rest if len(shapes[n]) != 2),
                   head=counts[head], hidden=shapes[embed][1])

    def bytes_read(self, rows_looked_up: int, itemsize: int) -> int:
        return (self.matmul + self.other + self.head + rows_looked_up * self.hidden) * itemsize


@functools.lru_cache(maxsize=8)
def _weight_counts(model_dir: str) -> WeightCounts:
    return WeightCounts.of_checkpoint(Path(model_dir))


def kv_bytes_per_token(cfg, itemsize: int) -> int:
    if getattr(cfg, "kv_lora_rank", 0):  # latent attention (DeepSeek): one latent row a token a layer
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def step_flops(weights: WeightCounts, cfg, shape: StepShape) -> float:
    """Matmul FLOPs (the LM head only for sampled rows) and attention FLOPs (QK and PV per query-key pair)."""
    tokens = shape.prefill_tokens + shape.decode_seqs
    samples = shape.prefill_samples + shape.decode_seqs
    pairs = shape.prefill_pairs + shape.decode_context
    return (2 * weights.matmul * tokens + 2 * weights.head * samples
            + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs)


def floor_of(engine: Engine, shape: StepShape, read_rate: float, flops_per_s: float) -> dict:
    """A step's bytes and floors, from the shape the engine reports it computed."""
    counts, cfg, itemsize = _weight_counts(engine.config.model), engine.model_config, engine.dtype.itemsize
    weights = counts.bytes_read(shape.prefill_tokens + shape.decode_seqs, itemsize)
    kv = (shape.decode_context + shape.prefill_tokens) * kv_bytes_per_token(cfg, itemsize)
    return {"weight_bytes": weights, "kv_bytes": kv, "floor_s": (weights + kv) / read_rate,
            "flop_floor_s": step_flops(counts, cfg, shape) / flops_per_s, "shape": shape._asdict()}


# ---- driving the engine ----

def context_prompts(points: list[StepPoint], vocab_size: int, seed: int = 2) -> list[list[int]]:
    """One prompt per sequence of the largest batch, as long as the longest context; shorter contexts
    are their prefixes. Token ids from [10, vocab): no special token of the default tokenizer."""
    g = torch.Generator().manual_seed(seed)
    batch, length = max(p.batch for p in points), max(p.context for p in points)
    return torch.randint(10, vocab_size, (batch, length), generator=g).tolist()


def chunk_prompts(points: list[StepPoint], vocab_size: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    chunk = max((p.chunk for p in points), default=0)
    return torch.randint(10, vocab_size, (MIXED_REPS, chunk), generator=g).tolist() if chunk else []


def _growth(point: StepPoint) -> int:
    """Tokens a sequence of this point may generate: while the batch is seated (at worst one step per
    sequence), then the warm-up and timed steps."""
    return point.batch + 8 + WARMUP_STEPS + TIMED_STEPS


def fit_context(points: list[StepPoint], max_model_len: int) -> list[StepPoint]:
    """Contexts cut so that every step of a point stays within the model's length (the 56M bench model
    holds 2,048 tokens)."""
    return list(dict.fromkeys(StepPoint(p.batch, min(p.context, max_model_len - _growth(p)), p.chunk)
                              for p in points))


def kv_blocks_needed(points: list[StepPoint], block_size: int = _BLOCK) -> int:
    """Blocks for the largest batch's prompts (cached between points), what its sequences generate, and
    the mixed point's prompt."""
    batch, context = max(p.batch for p in points), max(p.context for p in points)
    blocks = batch * (-(-context // block_size) + -(-max(map(_growth, points)) // block_size) + 1)
    blocks += -(-max(p.chunk for p in points) // block_size) + 1
    return blocks + 64


def build_engine(model_dir: str, points: list[StepPoint], dtype: str) -> Engine:
    batch = max(p.batch for p in points)
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, max_num_seqs=max(64, batch + 1),
                               max_num_batched_tokens=_BUDGET, enable_prefix_caching=True, block_size=_BLOCK,
                               num_kv_blocks=kv_blocks_needed(points)))


def run_points(engine: Engine, points: list[StepPoint], prompts: list[list[int]], chunks: list[list[int]],
               read_rate: float, flops_per_s: float) -> dict[str, dict]:
    results = {}
    for point in points:
        results[point.name] = _run_point(engine, point, prompts, chunks, read_rate, flops_per_s)
        engine.check_integrity()
        if engine.num_used_blocks:
            raise RuntimeError(f"{engine.num_used_blocks} KV blocks still used after point {point.name}")
    return results


def _run_point(engine: Engine, point: StepPoint, prompts, chunks, read_rate: float, flops_per_s: float) -> dict:
    prompts = [p[:point.context] for p in prompts[:point.batch]]
    # The prompts into the prefix cache first, each alone to its first token: seated afterwards, every
    # sequence recomputes only its last prompt token, so none decodes far past its context while others prefill.
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    if point.chunk:
        timed = [_time_mixed(engine, point, prompts, chunk, rep) for rep, chunk in enumerate(chunks)]
    else:
        timed = _time_decode(engine, point, prompts)
    steps = [s for s, _ in timed]
    floors = [floor_of(engine, shape, read_rate, flops_per_s) for _, shape in timed]
    median, floor = statistics.median(steps), statistics.median(f["floor_s"] for f in floors)
    flop_floor = statistics.median(f["flop_floor_s"] for f in floors)
    return {"batch": point.batch, "context": point.context, "chunk": point.chunk, "step_s": median,
            "mean_context": floors[0]["shape"]["decode_context"] / point.batch - 1,
            "best_step_s": min(steps), "steps_s": steps, "floor_s": floor, "flop_floor_s": flop_floor,
            "ratio_to_floor": median / floor, "ratio_to_roofline": median / max(floor, flop_floor),
            "weight_bytes": floors[0]["weight_bytes"], "kv_bytes": floors[0]["kv_bytes"],
            "shape": floors[0]["shape"], "decode_tokens_per_s": point.batch / median}


def _seat(engine: Engine, point: StepPoint, prompts: list[list[int]], tag: str) -> list[str]:
    """The batch's requests added (their prompts cached), stepped until each decodes, then warmed up."""
    ids = [f"{point.name}-{tag}-{i}" for i in range(point.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len, ignore_eos=True)  # ends at the model's length
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    bound = point.batch * point.context + 8  # one step per prompt token at worst
    for _ in range(bound):
        if not engine.prompts_pending():
            break
        engine.step()
    else:
        raise RuntimeError(f"{point.name}: prompts still pending after {bound} steps")
    for _ in range(WARMUP_STEPS):
        engine.step()
    return ids


def _time_decode(engine: Engine, point: StepPoint, prompts) -> list[tuple[float, StepShape]]:
    ids = _seat(engine, point, prompts, "decode")
    timed = []
    try:
        for _ in range(TIMED_STEPS):
            start = time.perf_counter()
            engine.step()
            timed.append((time.perf_counter() - start, engine.last_step_shape))
    finally:
        for rid in ids:
            engine.abort(rid)
    wrong = [shape for _, shape in timed if shape.decode_seqs != point.batch or shape.prefill_tokens]
    if wrong:
        raise RuntimeError(f"{point.name}: a timed step was not {point.batch} decodes: {wrong[0]}")
    return timed


def _time_mixed(engine: Engine, point: StepPoint, prompts, chunk: list[int], rep: int) -> tuple[float, StepShape]:
    """One rep: the decodes seated afresh (so their context stays the point's), a fresh prompt added, and
    the step that starts computing it timed."""
    ids = _seat(engine, point, prompts, f"rep{rep}")
    ids.append(f"{point.name}-rep{rep}-chunk")
    engine.add_request(ids[-1], chunk[:point.chunk], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    try:
        start = time.perf_counter()
        engine.step()
        elapsed, shape = time.perf_counter() - start, engine.last_step_shape
    finally:
        for rid in ids:
            engine.abort(rid)
    if shape.decode_seqs != point.batch or not shape.prefill_tokens:
        raise RuntimeError(f"{point.name}: the timed step was not {point.batch} decodes and a prompt: {shape}")
    return elapsed, shape


def run_vllm_points(python: str, model_dir: Path, points: list[StepPoint], prompts: list[list[int]],
                    chunks: list[list[int]], dtype: str, kv_cache_bytes: int) -> dict:
    """The same points through vLLM's engine (its own virtual environment); its result JSON as it wrote it."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, result = Path(tmp) / "steps.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps({
            "prompts": prompts, "chunk_prompts": chunks, "dtype": dtype, "warmup_steps": WARMUP_STEPS,
            "timed_steps": TIMED_STEPS, "max_num_batched_tokens": _BUDGET,
            "threads": torch.get_num_threads(),
            "kv_cache_gib": -(-kv_cache_bytes // (1 << 30)),
            "points": [{"name": p.name, "batch": p.batch, "context": p.context, "chunk": p.chunk} for p in points]}))
        cmd = [python, str(VLLM_SCRIPT), "--model", str(model_dir), "--steps", str(spec), "--out", str(result)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_VLLM_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vLLM steps run still going after {_VLLM_TIMEOUT_S} s") from e
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM steps run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def attention_backend(engine: Engine) -> str:
    attention = engine.runner.attention
    return getattr(attention, "name", type(attention).__name__)


def describe(name: str, point: dict) -> str:
    shape = point["shape"]
    chunk = f" + a {shape['prefill_tokens']}-token prompt" if point["chunk"] else ""
    vllm = ""
    if "vllm" in point:
        inexact = "" if point["vllm"]["exact"] else ", NOT exact: a timed call was not one step of this shape"
        if point["vllm"]["exact"] and not point["vllm_same_work"]:
            inexact = f", NOT the same work: vLLM computed all {point['chunk']} prompt tokens in its step"
        vllm = f"; vLLM {point['vllm_step_s'] * 1e3:.1f} ms (tandem takes {point['ratio_vs_vllm']:.2f}x its time{inexact})"
    decodes = f"{point['batch']} decode{'s' if point['batch'] > 1 else ''}"
    return (f"{name}: {decodes} at {point['context']} tokens of context (mean {point['mean_context']:.0f}){chunk}: "
            f"{point['step_s'] * 1e3:.1f} ms "
            f"(best {point['best_step_s'] * 1e3:.1f}); floor {point['floor_s'] * 1e3:.1f} ms "
            f"({(point['weight_bytes'] + point['kv_bytes']) / 1e6:.0f} MB) -> {point['ratio_to_floor']:.2f}x; "
            f"FLOP floor {point['flop_floor_s'] * 1e3:.1f} ms{vllm}")
