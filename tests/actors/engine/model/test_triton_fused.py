"""The fused Triton kernels of the CUDA step (triton_fused.py), run on the CPU in Triton's interpreter
(conftest.py): each against the torch ops it replaces, and whole models with and without them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a dev dependency (pyproject.toml); CUDA builds of torch ship it")

from actors.engine.model import triton_fused  # noqa: E402  (interpreted: conftest.py)
from actors.engine.model.attention import build_attention_batch  # noqa: E402
from actors.engine.model.llama import MLP, RMSNorm  # noqa: E402
from actors.engine.model.loader import load_model  # noqa: E402
from actors.engine.model.rope import RopeSpec, RotaryEmbedding  # noqa: E402
from tests.helpers.models import make_hf_model  # noqa: E402

G = torch.Generator().manual_seed(0)
# One ulp of the dtype, relative: the kernels round once where the torch ops round between steps.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_llamas(dtype):
    norm = RMSNorm(576, 1e-5)  # SmolLM2's width: not a power of two, the kernel masks the tail
    norm.weight.data = torch.randn(576, generator=G).to(dtype)
    x = (torch.randn(7, 576, generator=G) * 3).to(dtype)
    torch.testing.assert_close(triton_fused.rms_norm(x, norm.weight, norm.eps), norm(x), **TOLERANCE[dtype])
    heads = x.view(7, 9, 64)  # a per-head norm (Qwen3's q/k norm) sees [tokens, heads, head_dim]
    small = RMSNorm(64, 1e-6)
    torch.testing.assert_close(triton_fused.rms_norm(heads, small.weight, small.eps), small(heads), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_torch_ops(dtype):
    gate_up = (torch.randn(5, 2 * 1536 + 2 * 100, generator=G) * 4).to(dtype)  # 1636 wide: two column blocks
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(triton_fused.silu_and_mul(gate_up), MLP.act(None, gate).mul_(up), **TOLERANCE[dtype])


@pytest.mark.parametrize("rotary_dim,scaling", [(64, None), (48, None), (64, {"rope_type": "longrope",
    "short_factor": [1.0] * 32, "long_factor": [2.0] * 32, "original_max_position_embeddings": 16})])
def test_rotate_pairs_in_place_matches_the_rotary_embedding(rotary_dim, scaling):
    spec = RopeSpec(10000.0, scaling, rotary_dim, 256)
    rope = RotaryEmbedding(spec, 256)
    tokens, q_heads, kv_heads, dim = 6, 4, 2, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=G)
    positions = torch.tensor([0, 1, 7, 100, 255, 3])
    q, k = qkv[:, : q_heads * dim].view(tokens, q_heads, dim), qkv[:, q_heads * dim: (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    want_q, want_k = rope(positions, q, k)
    v_before = qkv[:, (q_heads + kv_heads) * dim:].clone()
    triton_fused.rotate_pairs_(qkv[:, : (q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim), rope.turns, positions)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim:], v_before)  # v is not a rotated head


@pytest.mark.parametrize("kind", ["llama", "qwen3", "phi3", "gemma2"])
def test_models_with_the_fused_kernels_give_the_same_logits(tmp_path, kind):
    """Qwen3 norms q and k per head before the rope (its rope stays torch), Phi-3 rotates part of each head,
    Gemma 2 keeps its own norms and GeLU but turns q and k with the kernel."""
    model = load_model(make_hf_model(tmp_path / kind, kind, seed=4))
    ids = torch.randint(3, model.cfg.vocab_size, (37,), generator=G)
    block = 8
    logits = {}
    for fused in (None, triton_fused):
        model.use_fused_kernels(fused)
        shape = (6, block, model.cfg.num_kv_heads, model.cfg.head_dim)
        kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.cfg.num_layers)]
        batch = build_attention_batch([37], [0], [list(range(5))], block, model.windows, torch.device("cpu"))
        with torch.inference_mode():
            logits[fused] = model(ids, batch, kv, torch.arange(37))
    assert sum(getattr(m, "fused", None) is not None for m in model.modules()) > 0
    torch.testing.assert_close(logits[triton_fused], logits[None], rtol=1e-4, atol=1e-4)
