"""The GPU path, checked on one CUDA GPU; skipped without one.

(a) bfloat16 parity with transformers: prefill logits and the paged KV cache (two chunks through a
    shuffled block table), and greedy decoding through the engine, teacher-forced against HF.
    bf16 rounding is judged against HF's own: both are compared with HF in float32 on the same
    weights, and ours may not stray more than a small multiple of what HF's bf16 run strays.
(b) decode step time against the floor set by reading the weights (and the KV context) once at the
    memory bandwidth measured in the same run (a large device-to-device copy); batch 1 and 32, timed
    with CUDA events, with synchronous and with overlapped steps (actors/engine/in_flight.py). Ratios are printed and written to $TANDEM_GPU_REPORT (JSON); nothing is asserted
    about time.
(c) KV pages GPU -> pinned host -> zmq -> pinned host -> GPU between a HandoffSender and a
    HandoffReceiver in this process, and the collective transport's choice of NCCL for CUDA caches.
    NCCL page traffic itself needs two ranks on two GPUs and is not checked here.
(d) every attention path the machine has: SDPA eager with torch's elementwise ops (the reference),
    tandem's Triton decode kernel with decode CUDA graphs and the fused Triton norm/rope/silu kernels,
    FlashInfer with graphs and the fused kernels (when flashinfer is installed). (a)'s greedy check
    and (b)'s timings run for each; (e) times an 8k-token prefill against the FLOP floor set by a
    large bf16 matmul measured in the same run.

Run: tests/gpu/run_gpu_checks.sh, or `pytest tests/gpu -s`. TANDEM_GPU_CHECKS_DEVICE=cpu runs the
same code on the CPU with a small benchmark model (a dry run of this file, not a GPU check).
"""

from __future__ import annotations

import json
import os
import queue
import time

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.model.attention import build_attention_batch
from actors.engine.model.backend_choice import installed
from actors.engine.model.loader import load_model
from actors.protocol.messages import KvRankEndpoint
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.tp_messages import KvSendPlan
from actors.worker.kv_handoff import HandoffReceiver, HandoffSender
from kv_transfer.page_format import HeadSlice
from tests.gpu.bench_model import BENCH_CONFIGS, write_random_checkpoint
from tests.helpers.models import make_hf_model
from tests.helpers.skips import needs

DEVICE = torch.device(os.environ.get("TANDEM_GPU_CHECKS_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(),
                                reason=needs("gpu", "torch.cuda.is_available() is False"))
BLOCK = 16
# A small Llama 3 (GQA, llama3 rope scaling), wide enough that bf16 rounding is realistic.
PARITY_MODEL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    intermediate_size=688, vocab_size=2048, max_position_embeddings=2048)
STRAY_FACTOR = 3.0  # ours vs fp32 may stray at most this many times HF-bf16 vs fp32 (plus a hair)

# (attention backend, CUDA graphs): the reference first. On a CPU dry run only the reference runs.
# A CPU dry run with TRITON_INTERPRET=1 adds the Triton path without graphs (slow: Triton's interpreter).
TRITON_HERE = installed("triton") and (ON_GPU or os.environ.get("TRITON_INTERPRET") == "1")
PATHS = [("sdpa", False)] + ([("triton", ON_GPU)] if TRITON_HERE else []) \
    + ([("flashinfer", True)] if ON_GPU and installed("flashinfer") else [])
PATH_IDS = [f"{backend}{'+graphs+fused' if graphs else ''}" for backend, graphs in PATHS]

REPORT: dict = {"device": torch.cuda.get_device_name(DEVICE) if ON_GPU and torch.cuda.is_available() else "cpu",
                "torch": torch.__version__}


@pytest.fixture(scope="module", autouse=True)
def report():
    yield REPORT
    print("\nGPU report:\n" + json.dumps(REPORT, indent=2))
    if os.environ.get("TANDEM_GPU_REPORT"):
        with open(os.environ["TANDEM_GPU_REPORT"], "w") as f:
            json.dump(REPORT, f, indent=2)


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("gpu") / "llama", "llama", seed=3, **PARITY_MODEL)


def _hf(model_dir, dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _cache_of(output):
    cache = getattr(output, "cache", None)  # newer transformers; `past_key_values` before
    return cache if cache is not None else output.past_key_values


def _hf_kv(cache, layer: int):
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[layer].keys, cache.layers[layer].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[layer], cache.value_cache[layer]
    return cache[layer]


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def test_bf16_prefill_logits_and_paged_kv_match_transformers(parity_dir):
    ours = load_model(parity_dir, "bfloat16", DEVICE)
    cfg = ours.cfg
    ids = _prompt(75, cfg.vocab_size, seed=1)
    blocks = -(-len(ids) // BLOCK)
    shape = (blocks + 2, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE), torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE))
          for _ in range(cfg.num_layers)]
    table = list(range(blocks + 1, 1, -1))  # not physical order: the table decides what is read
    logits = []
    for start, end in [(0, 40), (40, len(ids))]:  # the second chunk reads the first one's K/V from the cache
        batch = build_attention_batch([end - start], [start], [table], BLOCK, ours.windows, DEVICE)
        with torch.inference_mode():
            logits.append(ours(torch.tensor(ids[start:end], device=DEVICE), batch, kv, torch.arange(end - start, device=DEVICE)))
    got = torch.cat(logits)
    x = torch.tensor([ids], device=DEVICE)
    with torch.no_grad():
        ref32, ref16 = (_hf(parity_dir, dt)(x, use_cache=True) for dt in (torch.float32, torch.bfloat16))
    cache32, cache16 = _cache_of(ref32), _cache_of(ref16)
    scale = ref32.logits.abs().max().item()
    err_ours, err_hf = _max_err(got, ref32.logits[0]), _max_err(ref16.logits[0], ref32.logits[0])
    kv_ours = kv_hf = 0.0
    # Our cache holds keys in the rope's pair layout (rope.py): HF's key dims in that order.
    half, rotary = cfg.rope_spec().rotary_dim // 2, cfg.rope_spec().rotary_dim
    pair_order = [d for j in range(half) for d in (j, j + half)] + list(range(rotary, cfg.head_dim))
    for layer in range(cfg.num_layers):
        for i in range(2):
            mine = kv[layer][i].index_select(0, torch.tensor(table, device=DEVICE)).flatten(0, 1)[: len(ids)]
            ref, hf16 = _hf_kv(cache32, layer)[i][0], _hf_kv(cache16, layer)[i][0]
            if i == 0:
                ref, hf16 = ref[..., pair_order], hf16[..., pair_order]
            kv_ours = max(kv_ours, _max_err(mine.transpose(0, 1), ref))  # HF: [kv_heads, T, D]
            kv_hf = max(kv_hf, _max_err(hf16, ref))
    REPORT["parity_prefill"] = {"logit_scale": scale, "max_err_ours_bf16": err_ours, "max_err_hf_bf16": err_hf,
                                "kv_max_err_ours_bf16": kv_ours, "kv_max_err_hf_bf16": kv_hf}
    assert err_ours <= STRAY_FACTOR * err_hf + 1e-3 * scale, REPORT["parity_prefill"]
    assert kv_ours <= STRAY_FACTOR * kv_hf + 1e-3, REPORT["parity_prefill"]


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_bf16_greedy_decoding_matches_transformers(parity_dir, path):
    steps = 32
    backend, graphs = path
    engine = Engine(EngineConfig(model=str(parity_dir), dtype="bfloat16", device=str(DEVICE), block_size=BLOCK,
                                 num_kv_blocks=128, attention_backend=backend, cuda_graphs=graphs, fused_kernels=graphs,
                                 overlap_steps=graphs))
    assert engine.runner.attention.name == backend and (engine.runner.graphs is not None) == graphs
    assert engine.runner.kv_caches[0][0].device.type == DEVICE.type
    assert next(engine.runner.model.parameters()).device.type == DEVICE.type
    prompts = [_prompt(n, PARITY_MODEL["vocab_size"], seed=n) for n in (5, 19, 37, 64)]
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    results = engine.generate(prompts, greedy)
    engine.check_integrity()
    assert engine.num_used_blocks == 0
    if graphs:  # overlapped steps (in_flight.py) give the synchronous steps' tokens on the device too
        engine.overlap = False
        assert [r.outputs[0].token_ids for r in engine.generate(prompts, greedy)] == \
            [r.outputs[0].token_ids for r in results]
    hf32, hf16 = _hf(parity_dir, torch.float32), _hf(parity_dir, torch.bfloat16)
    exact = exact_hf16 = total = 0
    worst_gap = 0.0
    for prompt, result in zip(prompts, results):
        out = result.outputs[0].token_ids
        assert len(out) == steps
        x = torch.tensor([prompt + out], device=DEVICE)
        with torch.no_grad():  # teacher-forced: every step judged on the context we actually had
            ref = hf32(x).logits[0, len(prompt) - 1: -1].float()
            ref16 = hf16(x).logits[0, len(prompt) - 1: -1].float()
        noise = _max_err(ref16, ref)
        best = ref.max(-1).values
        exact_hf16 += int((ref16.argmax(-1) == ref.argmax(-1)).sum())
        chosen = ref.gather(1, torch.tensor(out, device=DEVICE)[:, None])[:, 0]
        gap = (best - chosen).max().item()  # 0 where we picked fp32's argmax; else how near a tie it was
        exact += int((chosen == best).sum())
        total += steps
        worst_gap = max(worst_gap, gap)
        assert gap <= STRAY_FACTOR * noise + 1e-3, (prompt[:4], gap, noise)
    replays = engine.runner.graphs.replays // 2 if graphs else 0  # two runs of the prompts
    REPORT[f"parity_greedy_{_path_id(path)}"] = {
        "steps": total, "ours_bf16_matching_fp32_argmax": exact, "hf_bf16_matching_fp32_argmax": exact_hf16,
        "worst_near_tie_gap": worst_gap, "graph_replays": replays}
    assert not graphs or replays >= steps - 2, "decode steps did not replay the CUDA graphs"
    assert exact >= exact_hf16 - 0.05 * total, REPORT[f"parity_greedy_{_path_id(path)}"]  # no more flips than HF's bf16, give or take


def _path_id(path) -> str:
    return PATH_IDS[PATHS.index(path)]


def _cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call; CUDA events on the GPU, wall time in a CPU dry run."""
    for _ in range(warmup):
        fn()
    if not ON_GPU:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000 / iters


def _copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = (4 << 30) if ON_GPU else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = _cuda_time(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * n / seconds


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    config = BENCH_CONFIGS["gpu" if ON_GPU else "cpu"]
    return write_random_checkpoint(tmp_path_factory.mktemp("bench") / "llama-1b", config, DEVICE)


@pytest.fixture(scope="module", params=PATHS, ids=PATH_IDS)
def bench_engine(bench_dir, request):
    backend, graphs = request.param
    engine = Engine(EngineConfig(model=str(bench_dir), dtype="bfloat16", device=str(DEVICE), block_size=BLOCK,
                                 kv_cache_memory_bytes=4 << 30 if ON_GPU else 64 << 20, max_num_seqs=64,
                                 enable_prefix_caching=False, attention_backend=backend, cuda_graphs=graphs,
                                 fused_kernels=graphs, overlap_steps=False))
    engine.path_id = _path_id(request.param)
    if graphs:
        REPORT[f"graphs_{engine.path_id}"] = {"buckets": list(engine.runner.graphs.buckets),
                                              "memory_mib": engine.runner.graphs.memory_bytes / 2**20}
    yield engine
    del engine
    if ON_GPU:
        torch.cuda.empty_cache()


@pytest.mark.parametrize("batch", [1, 32])
def test_decode_step_time_against_the_bandwidth_floor(bench_engine, batch):
    engine, context = bench_engine, 512
    runner = engine.runner
    bandwidth = _copy_bandwidth()
    params = dict(runner.model.named_parameters())
    weight_bytes = sum(p.nbytes for name, p in params.items() if name != "embed_tokens.weight")
    weight_bytes += batch * params["embed_tokens.weight"][0].nbytes  # only the looked-up rows are read
    kv_bytes = batch * context * runner.bytes_per_block // BLOCK
    floor_s = (weight_bytes + kv_bytes) / bandwidth

    # The model alone: one decode token per sequence over `context` cached tokens (contents do not matter).
    per_seq = -(-(context + 1) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    forward_s = _cuda_time(lambda: runner.execute([1] * batch, [1] * batch, [context] * batch, tables,
                                                  list(range(batch))), iters=20)

    # The whole engine step (schedule, forward, sample, post-process) once every request decodes.
    prompts = [_prompt(context, runner.cfg.vocab_size, seed=i) for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{batch}-{i}", p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started |= {out.request_id for out in engine.step()}
    step_s = _cuda_time(engine.step, iters=20)
    # Overlapped (in_flight.py): the host schedules and post-processes while the device runs the step.
    engine.overlap = True
    overlapped_s = _cuda_time(engine.step, iters=20)
    engine.overlap = False
    engine.step()  # brings the step left in flight back
    for i in range(batch):
        engine.abort(f"bench-{batch}-{i}")
    assert engine.num_used_blocks == 0

    REPORT[f"decode_batch_{batch}_{engine.path_id}"] = {
        "params_b": sum(p.numel() for p in params.values()) / 1e9, "context_tokens": context,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "floor_ms": floor_s * 1e3, "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes, "forward_ms": forward_s * 1e3, "engine_step_ms": step_s * 1e3,
        "forward_over_floor": forward_s / floor_s, "engine_step_over_floor": step_s / floor_s,
        "decode_tokens_per_s": batch / step_s, "overlapped_step_ms": overlapped_s * 1e3,
        "overlapped_step_over_floor": overlapped_s / floor_s, "overlapped_tokens_per_s": batch / overlapped_s,
    }
    print(f"\n{engine.path_id} batch {batch}: floor {floor_s * 1e3:.3f} ms, forward {forward_s * 1e3:.3f} ms "
          f"({forward_s / floor_s:.2f}x), engine step {step_s * 1e3:.3f} ms ({step_s / floor_s:.2f}x), "
          f"overlapped {overlapped_s * 1e3:.3f} ms ({overlapped_s / floor_s:.2f}x)")


def _matmul_flops_per_s() -> float:
    """bf16 FLOP/s of a large square matmul on this device (the prefill's floor rate)."""
    n = 8192 if ON_GPU else 512
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    seconds = _cuda_time(lambda: a @ b, iters=10)
    return 2 * n**3 / seconds


def test_prefill_time_against_the_flop_floor(bench_engine):
    """One prompt of 8k tokens (2k on a CPU dry run) in one forward, against the FLOPs of its matmuls and
    its causal attention at the measured matmul rate."""
    runner, tokens = bench_engine.runner, 8192 if ON_GPU else 2048
    cfg = runner.cfg
    rate = _matmul_flops_per_s()
    params = dict(runner.model.named_parameters())
    matmul_params = sum(p.numel() for name, p in params.items() if p.dim() == 2 and "embed_tokens" not in name)
    attention_flops = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2  # QK and PV, causal
    # Only the last token's logits are computed: the lm_head counts once, not per token.
    lm_head = params["lm_head.weight"].numel()
    flops = 2 * (matmul_params - lm_head) * tokens + 2 * lm_head + attention_flops
    blocks = -(-tokens // BLOCK)
    assert blocks <= runner.num_kv_blocks, f"{tokens} tokens need {blocks} KV blocks; the bench engine has {runner.num_kv_blocks}"
    ids = _prompt(tokens, cfg.vocab_size, seed=7)
    seconds = _cuda_time(lambda: runner.execute(ids, [tokens], [0], [list(range(blocks))], [0]), iters=3, warmup=1)
    floor_s = flops / rate
    REPORT[f"prefill_{tokens}_{bench_engine.path_id}"] = {
        "tokens": tokens, "tflops": flops / 1e12, "matmul_tflop_s": rate / 1e12, "floor_ms": floor_s * 1e3,
        "prefill_ms": seconds * 1e3, "prefill_over_floor": seconds / floor_s}
    print(f"\n{bench_engine.path_id} prefill {tokens}: floor {floor_s * 1e3:.1f} ms, took {seconds * 1e3:.1f} ms "
          f"({seconds / floor_s:.2f}x)")


def _caches(seed: int, num_blocks: int = 64, layers: int = 16):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (num_blocks, BLOCK, 8, 64)
    return [tuple(torch.randn(shape, generator=g, device=DEVICE).to(torch.bfloat16) for _ in range(2))
            for _ in range(layers)]


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_zmq_handoff_stages_gpu_pages_through_pinned_host_memory(transport):
    src, dst = _caches(1), _caches(2)
    before = [(k.clone(), v.clone()) for k, v in dst]
    done: queue.Queue = queue.Queue()
    heads = HeadSlice.whole(dst[0][0].shape[2])
    rx = HandoffReceiver(dst, 0, heads, admit=lambda piece: None, on_piece=done.put, transport=transport,
                         host="127.0.0.1")
    tx = HandoffSender(src)
    target = (KvRankEndpoint(rx.endpoint, 0, heads.count, heads.total),)
    src_ids, dest_ids = tuple(range(0, 48)), tuple(range(63, 15, -1))
    try:
        tx.send(KvSendPlan("warm", (0,), (0,), target, b"", 30))  # sockets, pinned pools
        assert done.get(timeout=30).stage == "landed"
        start = time.perf_counter()
        tx.send(KvSendPlan("t1", src_ids, dest_ids, target, b"", 30))
        event = done.get(timeout=30)
        seconds = time.perf_counter() - start
    finally:
        tx.close()
        rx.close()
    assert event.stage == "landed" and event.piece.lease_id == "t1"
    ids = torch.tensor(src_ids, device=DEVICE), torch.tensor(dest_ids, device=DEVICE)
    for (k, v), (sk, sv), (bk, bv) in zip(dst, src, before):
        for got, want, old in ((k, sk, bk), (v, sv, bv)):
            assert torch.equal(got[ids[1]].view(torch.int16), want[ids[0]].view(torch.int16))  # bit for bit
            untouched = torch.ones(got.shape[0], dtype=torch.bool, device=DEVICE)
            untouched[ids[1]] = False
            untouched[0] = False  # the warm-up block
            assert torch.equal(got[untouched], old[untouched])
    nbytes = sum(2 * k[ids[0]].nbytes for k, _ in src)
    REPORT[f"zmq_{transport}_staged"] = {"bytes": nbytes, "seconds": seconds, "gb_s": nbytes / seconds / 1e9}


def test_collective_picks_nccl_for_cuda_caches():
    if not ON_GPU:
        pytest.skip(needs("gpu", "NCCL is only chosen for CUDA caches (a TANDEM_GPU_CHECKS_DEVICE=cpu dry run)"))
    import torch.distributed as dist

    from kv_transfer.collective_transport import host_rendezvous, init_collective

    store, init_method = host_rendezvous("127.0.0.1")
    group = init_collective(init_method, 0, 1, device=DEVICE, timeout_s=30)
    try:
        assert dist.get_backend(group.data_group) == "nccl"
        assert dist.get_backend(group.header_group) == "gloo"  # preambles and headers: receive-from-any
        assert group.device.type == "cuda"
    finally:
        dist.destroy_process_group()
    REPORT["collective"] = {"data_backend": "nccl", "header_backend": "gloo", "gpus": torch.cuda.device_count()}

