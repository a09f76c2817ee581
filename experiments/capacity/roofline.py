"""Roofline profiles: step costs for a named GPU and model size, from peak FLOP/s and HBM bandwidth.

No measurement is involved: a prefill step costs FLOPs / (peak * mfu), a decode step costs the bytes it
must read (all weights once, plus the KV of every sequence) / (bandwidth * mbu), and every step costs
whichever bound is larger (see `RooflineCost` in profile.py). mfu and mbu are the fractions of peak a
good engine reaches; the defaults are typical of published vLLM/SGLang numbers, not measured here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.control.autoscale.profile import EngineLimits, EngineProfile, ModelShape, RooflineCost


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense (no sparsity) tensor-core peak
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float  # GPU-to-GPU in one node, one direction (half the datasheet's bidirectional figure)
    link_latency_s: float = 10e-6  # per all-reduce of a step's activations: an assumption, not measured here


GPUS = {
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3, 80 GB, NVLink 900 GB/s.
    "h100": GPU("H100 SXM", 989e12, 3.35e12, 80e9, 450e9),
    # NVIDIA H200 datasheet (SXM): 989 TFLOPS dense BF16 (same tensor cores as H100), 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s.
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 141e9, 450e9),
    # NVIDIA A100 datasheet (SXM 80GB): 312 TFLOPS dense BF16, 2,039 GB/s HBM2e, 80 GB, NVLink 600 GB/s.
    "a100": GPU("A100 SXM 80GB", 312e12, 2.039e12, 80e9, 300e9),
    # NVIDIA L4 datasheet: 121 TFLOPS dense BF16 (242 with sparsity), 300 GB/s GDDR6, 24 GB, PCIe Gen4 x16 64 GB/s.
    "l4": GPU("L4", 121e12, 300e9, 24e9, 32e9, 20e-6),
    # NVIDIA L40S datasheet: 362 TFLOPS dense BF16 (733 with sparsity), 864 GB/s GDDR6, 48 GB, PCIe Gen4 x16 64 GB/s.
    "l40s": GPU("L40S", 362e12, 864e9, 48e9, 32e9, 20e-6),
}

MODEL_PRESETS = {
    # Shapes from the models' Hugging Face config.json files.
    "llama3-8b": ModelShape("llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                            intermediate_size=14336, vocab_size=128256),
    "llama3-70b": ModelShape("llama3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                             head_dim=128, intermediate_size=28672, vocab_size=128256),
    "llama2-7b": ModelShape("llama2-7b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                            head_dim=128, intermediate_size=11008, vocab_size=32000),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
                             head_dim=128, intermediate_size=18944, vocab_size=152064),
    # Llama 4 Scout (17B active, 16 experts), its text model: every layer routes a token to 1 of 16 experts
    # of width 8192 beside a shared expert as wide, so a token runs a width of 16384 (intermediate_size here:
    # the FLOPs) while all 16 experts are held (num_params: the memory, and a decode step's weight reads).
    # KV: 48 layers x 8 KV heads x 128 x K and V x 2 bytes = 192 KiB a token; tandem caches every token in
    # the 36 chunked layers too (chunks of 8192), as in the global ones.
    "llama4-scout": ModelShape("llama4-scout", num_layers=48, hidden_size=5120, num_heads=40, num_kv_heads=8,
                               head_dim=128, intermediate_size=16384, vocab_size=202048,
                               num_params=48 * (5120 * (5120 + 2 * 1024) + 5120 * 5120  # attention
                                                + 16 * 5120 + 17 * 3 * 5120 * 8192 + 2 * 5120)  # router, experts, norms
                               + 2 * 202048 * 5120 + 5120),
    # gpt-oss-120b: 128 experts of width 2,880, 4 per token. The shape's MLP is the active one (4 x 2,880: the
    # FLOPs a token costs); num_params is every weight (bf16: tandem has no MXFP4). KV: 72 KiB a token, every
    # one of the 36 layers, the 18 sliding-window (128) ones included: tandem's block table is shared by all
    # layers, so a windowed layer keeps (and a handoff ships) its blocks behind the window.
    "gpt-oss-120b": ModelShape("gpt-oss-120b", num_layers=36, hidden_size=2880, num_heads=64, num_kv_heads=8,
                               head_dim=64, intermediate_size=4 * 2880, vocab_size=201088, num_params=116_829_156_672),
    # 671B parameters, 37B active a token (its model card); MLA caches kv_lora_rank 512 + qk_rope_head_dim 64
    # values a token a layer, where K and V of 128 heads of 128 would be 32,768. head_dim: v_head_dim.
    "deepseek-v3": ModelShape("deepseek-v3", num_layers=61, hidden_size=7168, num_heads=128, num_kv_heads=128,
                              head_dim=128, intermediate_size=18432, vocab_size=129280, num_params=671_000_000_000,
                              kv_latent_dim=512 + 64, active_params=37_000_000_000),
}


def model_shape(preset: str | None = None, hf_config: str | Path | None = None) -> ModelShape:
    """A preset name, or the directory / config.json of a Hugging Face checkpoint."""
    if (preset is None) == (hf_config is None):
        raise ValueError("give exactly one of a model preset (--model-preset) or a Hugging Face config (--model-config)")
    if preset is not None:
        if preset not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
        return MODEL_PRESETS[preset]
    path = Path(hf_config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no Hugging Face config at {path}")
    return ModelShape.from_hf_config(path.parent.name, json.loads(path.read_text()))


def roofline_profile(
    gpu: str,
    model: ModelShape,
    tensor_parallel: int = 1,
    mfu: float = 0.5,
    mbu: float = 0.7,
    overhead_s: float = 0.001,
    memory_fraction: float = 0.9,
    transfer_bytes_per_s: float = 25e9,
    transfer_latency_s: float = 0.001,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> EngineProfile:
    """One worker = `tensor_parallel` GPUs of this kind: each rank does 1/tp of the FLOPs and bytes (peak,
    bandwidth and memory x tp), and every step adds the ranks' two all-reduces per layer over the GPUs' link.

    The KV cache gets what `memory_fraction` of the memory leaves after the weights. The transfer
    defaults (25 GB/s, 1 ms) stand for a 200 Gb/s RDMA link between nodes; NVLink within a node is faster."""
    key = gpu.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPUS))}")
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    for name, value in (("mfu", mfu), ("mbu", mbu), ("memory_fraction", memory_fraction)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    spec = GPUS[key]
    weight_bytes = model.num_params * model.dtype_bytes
    kv_budget = spec.memory_bytes * tensor_parallel * memory_fraction - weight_bytes
    num_blocks = int(kv_budget // (model.kv_bytes_per_token * block_size))
    if num_blocks < 1:
        raise ValueError(f"{model.name} ({weight_bytes / 1e9:.0f} GB of weights) does not fit on {tensor_parallel} x "
                         f"{spec.name} ({spec.memory_bytes / 1e9:.0f} GB): raise --tensor-parallel")
    cost = RooflineCost(spec.bf16_flops * tensor_parallel, spec.hbm_bytes_per_s * tensor_parallel, mfu, mbu, overhead_s,
                        tensor_parallel, spec.link_bytes_per_s, spec.link_latency_s)
    limits = EngineLimits(block_size, num_blocks, max_num_seqs, max_num_batched_tokens)
    hardware = spec.name if tensor_parallel == 1 else f"{tensor_parallel} x {spec.name} (tensor parallel)"
    return EngineProfile("roofline", hardware, model, cost, limits, transfer_bytes_per_s, transfer_latency_s)
