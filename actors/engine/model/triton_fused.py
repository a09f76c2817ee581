"""Fused elementwise kernels in Triton for the CUDA decode step: one kernel where the torch ops take several.

A decode step of a 1B model at batch 1 moves ~2 GB of weights in ~0.5 ms at the bandwidth floor; eager
torch launches ~36 kernels per Llama layer, most of them tiny elementwise ones (RMSNorm alone is nine:
cast, norm, square, divide, add eps, rsqrt, scale, cast, weight). Even replayed from a CUDA graph each
costs a few microseconds. These replace them:

- `rms_norm`: x / RMS(x) times the weight, Llama's rounding (normalize in float32, round to the input
  dtype, then multiply by the weight) in one pass over each row;
- `silu_and_mul`: silu(gate) * up from the fused gate_up projection's output;
- `rotate_pairs_`: the rotary embedding of q and k in place, in the pair layout of rope.py (dims 2j and
  2j + 1 turn by `turns[position, j]`), for all heads of q and k in one launch.

Each matches the torch path it replaces to within the rounding of its dtype (they round once where torch
rounds between ops); the CPU tests run them in Triton's interpreter against that path. Used on CUDA only
(fused_ops.py decides); the CPU keeps the torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    y = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded before the weight, as Llama does
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _rms_norm[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), rows.shape[1], eps,
                                BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I]."""
    rows = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    n = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], n, dtype=rows.dtype, device=rows.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _rotate_pairs(x_ptr, turns_ptr, pos_ptr, stride_tok, stride_head, stride_turn, half,
                  BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    ok = j < half
    pos = tl.load(pos_ptr + tok)
    turn = turns_ptr + pos * stride_turn + 2 * j
    cos = tl.load(turn, mask=ok, other=1.0)
    sin = tl.load(turn + 1, mask=ok, other=0.0)
    base = x_ptr + tok * stride_tok + head * stride_head + 2 * j
    a = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(base + 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(base, (a * cos - b * sin).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(base + 1, (a * sin + b * cos).to(x_ptr.dtype.element_ty), mask=ok)


def rotate_pairs_(heads: torch.Tensor, turns: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate `heads` [T, num_heads, head_dim] (any token and head strides, unit dim stride) in place: the
    first 2 * turns.shape[1] dims of each head, pair j by turns[positions[t], j] (complex, rope.py)."""
    if heads.stride(-1) != 1:
        raise ValueError("rotate_pairs_ needs each head's dims side by side (unit stride)")
    table = torch.view_as_real(turns)  # [positions, pairs, (cos, sin)] float32
    half = turns.shape[1]
    _rotate_pairs[(heads.shape[0], heads.shape[1])](heads, table, positions, heads.stride(0), heads.stride(1),
                                                    table.stride(0), half, BLOCK=triton.next_power_of_2(half))
