"""`tandem plan`: simulator answers computed by hand, the pool-ratio search on profiles whose best ratio
is known (acceptance 4), roofline numbers against a hand calculation, and the measured profiler."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from experiments.loadgen.spec import LengthDist
from experiments.capacity.metrics import SLO, summarize
from cluster.control.autoscale.profile import BatchShape, EngineLimits, EngineProfile, LinearCost, ModelShape
from experiments.capacity.roofline import MODEL_PRESETS, roofline_profile
from experiments.capacity.search import recommend, search
from experiments.capacity.simulator import Layout, SimOptions, simulate
from experiments.capacity.workload import SimRequest
from experiments.planner.workload import synthetic_workload

TOY = ModelShape("toy", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, dtype_bytes=4)  # 512 KV bytes per token
NO_LOCAL = SimOptions(local_prefill=False)


def linear_profile(prefill_per_token=1e-3, decode_per_seq=0.0, decode_base=0.01, limits=EngineLimits(16, 1000, 8, 512),
                   bytes_per_s=1e6, latency=0.005) -> EngineProfile:
    cost = LinearCost(0.0, prefill_per_token, 0.0, decode_base, decode_per_seq, 0.0)
    return EngineProfile("measured", "test", TOY, cost, limits, bytes_per_s, latency)


# ---- one request, by hand ----

def test_one_request_disaggregated_prefill_then_transfer_then_decode_steps():
    p = linear_profile()
    result = simulate(p, Layout.disaggregated(1, 1), [SimRequest(0.0, 100, 5)], NO_LOCAL)
    seq = result.seqs[0]
    prefill, transfer, step = 100 * 1e-3, 0.005 + 100 * 512 / 1e6, 0.01
    assert (seq.prefill_worker, seq.decode_worker) == ("prefill-0", "decode-0")
    # The first token leaves the prefill worker with its last chunk; the KV transfer delays token 2.
    assert result.token_times(seq) == pytest.approx([prefill] + [prefill + transfer + k * step for k in (1, 2, 3, 4)])
    s = summarize(result, SLO())
    assert s.ttft.p50 == pytest.approx(prefill)
    assert s.tpot.p50 == pytest.approx((transfer + 4 * step) / 4)
    assert s.e2e.p50 == pytest.approx(prefill + transfer + 4 * step)


def test_one_request_colocated_decodes_right_after_its_prefill():
    p = linear_profile()
    result = simulate(p, Layout.colocated_workers(1), [SimRequest(2.0, 100, 5)])
    assert result.token_times(result.seqs[0]) == pytest.approx([2.1, 2.11, 2.12, 2.13, 2.14])
    s = summarize(result, SLO())
    assert (s.ttft.p50, s.tpot.p50, s.itl.p99) == pytest.approx((0.1, 0.01, 0.01))


def test_queued_prompts_on_one_prefill_worker_get_ttfts_in_arithmetic_progression():
    # A token budget of exactly one prompt: the worker prefills them one step each, in arrival order.
    p = linear_profile(limits=EngineLimits(16, 1000, 8, 100))
    result = simulate(p, Layout.disaggregated(1, 1), [SimRequest(0.0, 100, 3)] * 5, NO_LOCAL)
    assert [s.first_token_s for s in result.seqs] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_a_short_prefill_pool_overflows_onto_the_decode_workers_in_capped_chunks():
    """A burst of 1,000-token prompts at about twice what one H100 prefill worker computes: without overflow
    they queue there and miss a 0.5 s TTFT; with it (the shipped rule) the four decode workers take the
    excess, 512 prompt tokens a step at most, and the TPOT SLO still holds."""
    profile = roofline_profile("h100", MODEL_PRESETS["llama3-8b"])
    requests = [SimRequest(i * 0.015, 1000, 100) for i in range(1000)]
    slo = SLO(0.5, 0.02)
    bounded = summarize(simulate(profile, Layout.disaggregated(1, 4), requests,
                                 SimOptions(local_prefill_overflow_s=None)), slo)
    result = simulate(profile, Layout.disaggregated(1, 4), requests)
    overflow = summarize(result, slo)
    assert bounded.attainment < 0.2 and overflow.attainment > 0.9
    locally = [s for s in result.seqs if s.prefill_worker == s.decode_worker]
    assert len(locally) > 300 and all(s.request.prompt_len > 512 for s in locally[:10])
    assert overflow.tpot.p90 < 0.02


def test_a_request_too_big_for_any_worker_is_rejected_not_lost():
    p = linear_profile(limits=EngineLimits(16, 10, 8, 512))
    result = simulate(p, Layout.colocated_workers(1), [SimRequest(0.0, 100, 100), SimRequest(0.0, 20, 4)])
    s = summarize(result, SLO(ttft_s=10, tpot_s=10))
    assert (s.rejected, s.completed, s.attainment) == (1, 1, 0.5)


# ---- aggregates ----

def test_runs_are_deterministic_goodput_is_at_most_throughput_and_more_load_never_helps():
    p = linear_profile(prefill_per_token=2e-4, decode_per_seq=5e-4, decode_base=0.005,
                       limits=EngineLimits(16, 4096, 32, 1024), bytes_per_s=1e9)
    work = synthetic_workload(200, LengthDist.parse("lognormal:400:200"), LengthDist.parse("uniform:10:60"), seed=3)
    slo = SLO(ttft_s=0.3, tpot_s=0.03)
    for layout in (Layout.disaggregated(1, 1), Layout.colocated_workers(2)):
        first = simulate(p, layout, work.at_rate(8.0))
        again = simulate(p, layout, work.at_rate(8.0))
        assert [s.finish_s for s in first.seqs] == [s.finish_s for s in again.seqs]
        att = []
        for rate in (1, 2, 4, 8, 16, 32):
            s = summarize(simulate(p, layout, work.at_rate(rate)), slo)
            assert s.completed == 200 and s.goodput_rps <= s.throughput_rps
            assert s.ttft.p50 <= s.ttft.p90 <= s.ttft.p99
            att.append(s.attainment)
        assert att == sorted(att, reverse=True), att
        assert att[0] > 0.95 and att[-1] < 0.5  # the range spans light load to overload


# ---- acceptance 4: the search finds the ratio a synthetic profile dictates ----

@pytest.mark.parametrize("prefill_s, decode_s, best", [(0.030, 0.010, (3, 1)), (0.010, 0.030, (1, 3))])
def test_search_recommends_the_ratio_that_balances_prefill_and_decode_work(prefill_s, decode_s, best):
    """Each request costs prefill_s of prefill-worker time (100-token prompts, one per step: no batching
    gain) and about decode_s of decode-worker time (10 decode steps, each costing decode_s / 10 per
    sequence in the batch, plus a small base). A 3:1 (or 1:3) work ratio makes 3P:1D (or 1P:3D) the
    only 4-worker split where neither pool idles: about 100 req/s, 25 per worker."""
    limits = EngineLimits(16, 4096, 64, 100)
    p = linear_profile(prefill_per_token=prefill_s / 100, decode_per_seq=decode_s / 10, decode_base=decode_s / 100,
                       limits=limits, bytes_per_s=1e12, latency=0.0)
    work = synthetic_workload(400, LengthDist.parse("100"), LengthDist.parse("11"), "gamma", burstiness=20, seed=0)
    slo = SLO(ttft_s=5 * prefill_s, tpot_s=3 * decode_s)
    rows = search(p, work, slo, max_workers=4, mode="disaggregated", options=NO_LOCAL)
    rec = recommend(rows)
    assert (rec.layout.prefill, rec.layout.decode) == best
    assert f"prefill:\n  replicas: {best[0]}\ndecode:\n  replicas: {best[1]}\n" in rec.yaml()
    # A finite run tolerates a slight overload before 10% of requests miss, hence the 10% above capacity.
    assert 80 <= rows[0].max_rate_rps <= 110
    # With a target rate, the smallest layout that sustains it (here a 2-worker one) is chosen instead.
    small = next(r for r in rows if r.layout.num_workers == 2)
    assert recommend(rows, target_rate=small.max_rate_rps * 0.99).layout == small.layout


# ---- roofline ----

def test_roofline_llama3_8b_on_h100_matches_a_hand_calculation():
    model = MODEL_PRESETS["llama3-8b"]
    assert model.num_params == pytest.approx(8.03e9, rel=0.01)
    assert model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    p = roofline_profile("h100", model, mfu=0.5, mbu=0.7, overhead_s=0.0)
    # Decode, batch 1: every bf16 weight read once at 70% of 3.35 TB/s = 6.85 ms.
    decode = p.step_s(BatchShape(decode_seqs=1, decode_context=1))
    assert decode == pytest.approx(8.03e9 * 2 / (3.35e12 * 0.7), rel=0.02)
    # Prefill of 1024 tokens: the 2 x params x tokens rule at 50% of 989 TFLOP/s says 33 ms; it counts the
    # embedding and lm_head for every token (we count the lm_head once) and omits attention: within 15%.
    prefill = p.prefill_s(1024)
    assert prefill == pytest.approx(2 * 8.03e9 * 1024 / (989e12 * 0.5), rel=0.15)
    # KV capacity: 90% of 80 GB minus 16 GB of weights, in 16-token blocks of 2 MiB.
    assert p.engine.num_kv_blocks == int((0.9 * 80e9 - 2 * model.num_params) // (131072 * 16))
    # Batch 64 decode is still memory-bound: far less than 64 x the batch-1 step.
    assert p.step_s(BatchShape(decode_seqs=64, decode_context=64 * 1024)) < 2 * decode


def test_llama4_scout_preset_holds_every_expert_and_runs_one():
    model = MODEL_PRESETS["llama4-scout"]
    assert model.num_params == pytest.approx(107.8e9, rel=0.001)  # the text model of Scout's "109B"
    assert model.kv_bytes_per_token == 2 * 48 * 8 * 128 * 2  # 192 KiB
    # Per token, attention and 2 experts' width (routed + shared): near the "17B active" of its name.
    assert model.layer_params * model.num_layers == pytest.approx(15.1e9, rel=0.01)
    with pytest.raises(ValueError, match="does not fit"):
        roofline_profile("h100", model)  # 216 GB of bf16 weights
    p = roofline_profile("h100", model, tensor_parallel=4)
    assert p.engine.num_kv_blocks == int((0.9 * 4 * 80e9 - 2 * model.num_params) // (196608 * 16))
    # --model-config on Scout's text config (its published sizes) gives the preset's shape.
    scout = {"model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40,
             "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
             "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 202048}
    assert ModelShape.from_hf_config("llama4-scout", scout) == model


def test_a_llama4_config_counts_the_parameters_transformers_builds(tmp_path):
    import transformers

    from experiments.capacity.roofline import model_shape
    from tests.helpers.models import make_hf_model

    model_dir = make_hf_model(tmp_path / "llama4", "llama4")  # 2 MoE layers of 4 experts, 2 dense ones
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    shape = model_shape(hf_config=model_dir)
    assert shape.num_params == sum(p.numel() for p in hf.parameters())
    assert shape.intermediate_size == (2 * 2 * 32 + 2 * 96) // 4  # routed + shared in MoE layers, dense in others


def test_gpt_oss_120b_preset_counts_every_weight_and_the_active_experts_flops():
    model = MODEL_PRESETS["gpt-oss-120b"]
    assert model.kv_bytes_per_token == 2 * 36 * 8 * 64 * 2 == 73728  # K and V of 8 heads of 64, 36 layers, bf16
    assert model.num_params == pytest.approx(116.8e9, rel=0.001)  # OpenAI's model card: 116.8B total
    # 4 of 128 experts a token: the FLOPs of about 5B weights a token, the embedding and lm_head aside.
    assert model.layer_params * model.num_layers == pytest.approx(4.6e9, rel=0.02)
    with pytest.raises(ValueError, match="does not fit"):  # 234 GB of bf16 weights
        roofline_profile("h200", model)
    assert roofline_profile("h100", model, tensor_parallel=4).engine.num_kv_blocks > 0


def test_roofline_deepseek_v3_caches_one_latent_a_token_and_computes_with_its_active_experts(capsys):
    """MLA: 576 values a token a layer (kv_lora_rank 512 + rope 64) where 128 heads' K and V would be 32,768;
    a prefill computes with the 37B active parameters, not all 671B."""
    model = MODEL_PRESETS["deepseek-v3"]
    assert model.kv_bytes_per_token == 61 * 576 * 2 == 70_272
    per_head_kv = 2 * model.num_layers * model.num_heads * 128 * 2  # K and V of 128 heads of 128: 3,997,696
    assert per_head_kv / model.kv_bytes_per_token == pytest.approx(56.9, abs=0.05)
    p = roofline_profile("h200", model, tensor_parallel=16, mfu=0.5, mbu=0.7, overhead_s=0.0)
    assert model.token_params == 37e9 - 2 * 129280 * 7168
    # 8,192 prompt tokens: at least the active parameters' FLOPs, far below all 671B's (1.39 s).
    active, every = (2 * n * 8192 / (16 * 989e12 * 0.5) for n in (37e9, 671e9))
    assert active < p.prefill_s(8192) < every / 3
    assert p.engine.num_kv_blocks == int((0.9 * 16 * 141e9 - 2 * 671e9) // (70_272 * 16))
    assert main(["plan", "--gpu", "h200", "--model-preset", "deepseek-v3", "--tensor-parallel", "16",
                 "--slo-tpot-ms", "200", "--max-workers", "2", "--num-requests", "20"]) == 0
    assert "model deepseek-v3, KV 70272 bytes a token" in capsys.readouterr().out


def test_roofline_refuses_a_model_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        roofline_profile("l4", MODEL_PRESETS["llama3-70b"])


# ---- measured profile and the CLI ----

def test_profile_of_the_default_model_then_plan_from_it(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main(["plan", "profile", "--max-num-batched-tokens", "256", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    # Prompts longer than the budget are timed chunk by chunk, as the workers run them.
    chunks = [s for s in data["samples"] if s["kind"] == "prefill" and s.get("context", 0) > 0]
    assert {s["context"] for s in chunks} == {256, 512, 768}
    assert all(s["tokens"] <= 256 for s in data["samples"] if s["kind"] == "prefill")
    assert data["format"] == "tandem-profile/1" and data["source"] == "measured"
    assert data["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4  # tiny Llama: 4 layers, 2 KV heads of 32, float32
    assert {s["kind"] for s in data["samples"]} == {"prefill", "decode"}
    assert all(s["s"] > 0 for s in data["samples"])
    assert data["transfer"]["bytes_per_s"] > 0 and data["transfer"]["latency_s"] >= 0
    profile = EngineProfile.load(path)
    steps = [profile.step_s(BatchShape(n, n * (n + 1) // 2, 1)) for n in (16, 128, 1024)]
    assert 0 < steps[0] <= steps[1] <= steps[2]
    decodes = [profile.step_s(BatchShape(decode_seqs=b, decode_context=b * 100)) for b in (1, 8, 64)]
    assert 0 < decodes[0] <= decodes[1] <= decodes[2]

    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(path), "--prompt-len", "uniform:32:256", "--output-len", "16",
                 "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--max-workers", "2", "--num-requests", "60",
                 "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert {row["name"] for row in plan["layouts"]} == {"1P:1D", "1C", "2C"}
    assert plan["recommendation"]["name"] in {"1P:1D", "1C", "2C"}
    assert "replicas:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan", "--gpu", "h100", "--model-preset", "llama3-8b"], "at least one SLO"),
    (["plan", "--slo-ttft-ms", "100"], "either --profile"),
    (["plan", "--gpu", "h100", "--model-preset", "llama3-8b", "--slo-ttft-ms", "100", "--prompt-len", "normal:5"],
     "bad length 'normal:5'"),
    (["plan", "--profile", "/nonexistent.json", "--slo-ttft-ms", "100"], "does not exist"),
])
def test_bad_plan_input_is_a_clear_error(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_tandem_config_gives_the_layout_limits_and_routing_to_simulate():
    from dataclasses import replace
    from pathlib import Path

    from cluster.control.config import TandemConfig

    configs = Path(__file__).resolve().parents[2] / "configs"
    colocated, local = TandemConfig.from_file(configs / "colocated.yaml"), TandemConfig.from_file(configs / "local.yaml")
    assert (Layout.from_config(colocated), Layout.from_config(local)) == (Layout.colocated_workers(2), Layout.disaggregated(1, 1))
    limits = EngineLimits.from_config(colocated)
    assert (limits.num_kv_blocks, limits.max_num_batched_tokens, limits.max_num_seqs) == (4096, 512, 64)
    options = SimOptions.from_config(local)
    assert (options.routing, options.local_prefill) == ("cache_aware", True)
    # A 1000-token prompt on the colocated config is chunked by its 512-token budget: two prefill steps.
    profile = replace(linear_profile(), engine=limits)
    result = simulate(profile, Layout.from_config(colocated), [SimRequest(0.0, 1000, 2)], options)
    assert len(result.step_ends["colocated-0"]) == 3 and result.seqs[0].first_token_s == pytest.approx(1.0)


def test_roofline_tensor_parallel_adds_the_all_reduces():
    """TP=4 on H100s: a quarter of the FLOPs and bytes per rank, plus 2 ring all-reduces per layer of the
    step's activations over NVLink (450 GB/s one way, 10 us each)."""
    model = MODEL_PRESETS["llama3-70b"]
    p = roofline_profile("h100", model, tensor_parallel=4, mfu=0.5, mbu=0.7, overhead_s=0.0)
    shape = BatchShape(decode_seqs=8, decode_context=8 * 512)
    activations = 8 * model.hidden_size * 2
    allreduce = 2 * model.num_layers * (2 * 3 / 4 * activations / 450e9 + 10e-6)
    assert p.cost.allreduce_s(shape, model) == pytest.approx(allreduce)
    weights_and_kv = (model.num_params * 2 + model.kv_bytes_per_token * 8 * 512) / (4 * 3.35e12 * 0.7)
    assert p.step_s(shape) == pytest.approx(weights_and_kv + allreduce, rel=1e-6)
    assert roofline_profile("h100", model, tensor_parallel=2).cost.allreduce_s(shape, model) < allreduce  # fewer ranks: less of the ring
    assert roofline_profile("h200", MODEL_PRESETS["llama3-8b"]).cost.allreduce_s(shape, model) == 0


def test_a_tensor_parallel_recommendation_names_the_ranks_per_worker():
    import yaml

    from cluster.control.config import TandemConfig
    from experiments.capacity.search import Recommendation
    from experiments.capacity.simulator import Layout

    text = Recommendation(Layout("colocated", colocated=2, colocated_tp=4), 1.0, "best").yaml()
    config = TandemConfig.model_validate(yaml.safe_load(text))
    assert config.colocated.tensor_parallel_size == 4 and Layout.from_config(config).describe() == "2Cx4"
    split = Layout("disaggregated", prefill=2, decode=1, prefill_tp=2, decode_tp=4)
    assert split.describe() == "2Px2:1Dx4" and split.num_gpus == 8
    assert "does not run tensor-parallel prefill" in Recommendation(split, 1.0, "best").yaml()


def test_search_sizes_each_pool_independently(tmp_path):
    """llama3-70b on H100s, roofline: every pool at TP 2, 4 and 8, ranked by goodput per GPU; a decode step
    costs less on a bigger group, and the table and JSON name each layout's GPUs."""
    model = MODEL_PRESETS["llama3-70b"]
    profiles = {tp: roofline_profile("h100", model, tensor_parallel=tp) for tp in (2, 4, 8)}
    shape = BatchShape(decode_seqs=16, decode_context=16 * 1024)
    assert profiles[8].step_s(shape) < profiles[4].step_s(shape) < profiles[2].step_s(shape)
    workload = synthetic_workload(60, LengthDist.parse("1024"), LengthDist.parse("128"), "poisson", 1.0, 0)
    rows = search(profiles, workload, SLO(ttft_s=1.0, tpot_s=0.05), max_workers=2, mode="disaggregated")
    assert len(rows) == 9  # 1P:1D, each pool at 3 sizes
    assert {(r.layout.prefill_tp, r.layout.decode_tp) for r in rows} == {(a, b) for a in (2, 4, 8) for b in (2, 4, 8)}
    per_gpu = [r.per_gpu_rps for r in rows]
    assert per_gpu == sorted(per_gpu, reverse=True) and per_gpu[0] > 0
    # Each layout's max rate meets the target in its own simulation (the per-pool costs are the ones searched).
    assert all(r.summary is None or r.summary.attainment >= 0.9 for r in rows)
