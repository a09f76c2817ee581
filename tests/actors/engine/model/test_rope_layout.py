"""The rope's pair layout (rope.py): rotating q and k stored with each rotate-half pair side by side, as one
complex multiply, gives Hugging Face's rotate-half result in that layout, and the scores q . k are the same."""

from __future__ import annotations

import pytest
import torch

from actors.engine.model.rope import RopeSpec, RotaryEmbedding, interleave_rotary, inverse_frequencies


def _hf_rotate_half(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, context_len: int) -> torch.Tensor:
    """transformers' formula: x * cos + rotate_half(x) * sin on the first rotary_dim dims."""
    inv_freq, scale = inverse_frequencies(spec, context_len)
    freqs = torch.outer(positions.float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scale)[:, None], (emb.sin() * scale)[:, None]
    turned, kept = x[..., : spec.rotary_dim], x[..., spec.rotary_dim :]
    half = spec.rotary_dim // 2
    rotated = torch.cat((-turned[..., half:], turned[..., :half]), dim=-1)
    return torch.cat((turned * cos + rotated * sin, kept), dim=-1)


@pytest.mark.parametrize("rotary_dim", [64, 48])  # whole heads, and Phi-3's partial rotation
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0}])
def test_pair_layout_rotates_as_rotate_half_and_keeps_the_scores(rotary_dim, scaling):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim, context = 37, 4, 2, 64, 256
    spec = RopeSpec(10_000.0, scaling, rotary_dim, context)
    positions = torch.randint(0, context, (tokens,), generator=gen)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    order = interleave_rotary(torch.arange(head_dim), 1, head_dim, rotary_dim)
    assert sorted(order.tolist()) == list(range(head_dim)) and order[rotary_dim:].tolist() == list(range(rotary_dim, head_dim))

    q_pairs, k_pairs = RotaryEmbedding(spec, context)(positions, q[..., order], k[..., order])
    q_hf, k_hf = _hf_rotate_half(q, positions, spec, context), _hf_rotate_half(k, positions, spec, context)
    torch.testing.assert_close(q_pairs, q_hf[..., order], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_pairs, k_hf[..., order], rtol=1e-5, atol=1e-5)
    scores = torch.einsum("thd,shd->tsh", q_pairs[:, ::2], k_pairs)  # heads 0 and 2 against kv heads 0 and 1
    torch.testing.assert_close(scores, torch.einsum("thd,shd->tsh", q_hf[:, ::2], k_hf), rtol=1e-4, atol=1e-4)


def test_a_projection_weight_is_permuted_head_by_head():
    heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(heads * head_dim, hidden)
    out = interleave_rotary(weight, heads, head_dim, head_dim)
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    for h in range(heads):
        torch.testing.assert_close(out[h * head_dim:(h + 1) * head_dim], weight[h * head_dim + torch.tensor(order)])
