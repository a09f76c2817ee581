"""A paged decode-attention kernel in Triton: each sequence's one query token attends to its context by
reading K/V straight from the paged cache through its block table (no gathered copy of the context, as
the SDPA path makes). Triton ships with CUDA builds of torch; on a CPU the same kernel runs in Triton's
interpreter (TRITON_INTERPRET=1, set before triton is imported), which is how the CPU tests check it.

One program per (sequence, query head); it walks the context in tiles of BLOCK_N tokens with an online
softmax in float32. The loop bound is read from `seq_lens` on the device, so a launch has the same shape
whatever the contexts are: a CUDA graph can replay it (decode_graphs.py). GQA heads of one group each
read their KV head (the second read mostly hits L2); a grouped variant would read it once.

Masks, as the SDPA path has them: keys at positions < seq_len, and with a window w, positions >=
seq_len - w (the query at seq_len - 1 and the w - 1 before it); with Llama 4's attention chunk c, positions
from the start of the query's chunk (a multiple of c) on. A softcap c turns scores s into
c * tanh(s / c) before the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # context tokens per tile


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, scale, softcap, window, chunk,
                  stride_q_tok, stride_q_head, stride_c_block, stride_c_tok, stride_c_head, stride_table,
                  stride_o_tok, stride_o_head,
                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  TILE: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_tok + head * stride_q_head + d, mask=d_ok, other=0.0).to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    lo = tl.where(chunk > 0, tl.maximum(lo, (seq_len - 1) // tl.maximum(chunk, 1) * chunk), lo)
    m_i = tl.full((1,), float("-inf"), tl.float32)
    l_i = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    start = (lo // TILE) * TILE
    while start < seq_len:  # (a while loop: Triton's interpreter cannot take a loaded value as a range bound)
        pos = start + tl.arange(0, TILE)
        valid = (pos < seq_len) & (pos >= lo)
        page = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        kv_mask = valid[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))  # c * tanh(s / c)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        start += TILE
    out = acc / l_i
    tl.store(out_ptr + seq * stride_o_tok + head * stride_o_head + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                           chunk: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence, at position seq_lens - 1, its K/V already in the cache);
    caches [num_blocks, block_size, KVH, D]; block_tables int32 [B, >= pages of the longest context];
    seq_lens int32 [B]. Returns [B, H, D] in q's dtype."""
    batch, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("paged_decode_attention needs unit-stride head dims and K/V caches of one layout")
    out = torch.empty_like(q)
    _paged_decode[(batch, heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale, softcap or 0.0, window or 0, chunk or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        TILE=BLOCK_N, SOFTCAP=softcap is not None,
    )
    return out
