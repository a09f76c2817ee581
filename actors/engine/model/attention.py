"""Paged attention over a flattened mixed batch of prefill chunks and decode tokens: the `sdpa` backend
(attention_backend.py), torch's scaled_dot_product_attention over gathered blocks. It runs on every
device and every layer kind, and is the reference the other backends are checked against.

The KV cache of one layer is two tensors `[num_blocks, block_size, kv_heads, head_dim]`. New K/V are
written through a slot mapping (slot = block_id * block_size + offset); attention reads a sequence's
context back through its block table. A batch is flat: the tokens of every scheduled sequence
concatenated, with per-sequence query lengths and context lengths; no sequence is padded to another's
length in the forward pass.

`AttentionBatch` is built once per engine step (`build_attention_batch`) and shared by every layer, so
the index arithmetic costs nothing per layer. Layers may differ in their attention window (sliding or
full, interleaved in one model): the batch holds one decode mask per distinct window, and each layer
masks its prefill chunks with its own. Llama 4's chunked layers (a query sees only the keys of its own
chunk of positions) get their decode mask built on the first layer that asks, then shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.engine.model.attention_backend import (
    AttentionBackend, LayerAttention, StepAttention, positions_and_slots, sink_logits, write_new_kv,
)
from actors.engine.model.host_to_device import tensor_on, to_device


@dataclass
class PrefillSlice:
    """One sequence that runs more than one query token this step (a prefill chunk), or `count` fresh
    prompts of the same length side by side in the flat batch: those attend in one batched call (one
    kernel call over all their heads instead of a Python loop of small ones)."""

    token_start: int  # offset of its first query token in the flat batch
    query_len: int  # per sequence
    context_len: int  # tokens in the cache after this step (computed before + query_len)
    context_blocks: torch.Tensor | None  # block table covering the context; None when the chunk is the whole context
    count: int = 1  # sequences (more than one only for whole fresh prompts)


@dataclass
class AttentionBatch(StepAttention):
    positions: torch.Tensor  # [T] position of every flat token
    slot_mapping: torch.Tensor  # [T] cache slot every new K/V is written to
    prefills: list[PrefillSlice]
    # Decode tokens (query_len == 1), attended to in one padded call over the gathered context.
    decode_token_idx: torch.Tensor | None  # [B] flat index of each decode token
    decode_blocks: torch.Tensor | None  # [B, max_blocks] block tables (padded with block 0)
    # Per window of the model's layers (None: full attention): [B, 1, 1, max_blocks * block_size], True
    # where a key may be attended.
    decode_masks: dict[int | None, torch.Tensor] | None
    decode_lens: torch.Tensor | None = None  # [B] context length of each decode sequence (CPU)
    block_size: int = 0
    chunked_masks: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)  # by (window, chunk)

    def attend(self, q, k, v, k_cache, v_cache, layer: LayerAttention) -> torch.Tensor:
        return paged_attention(q, k, v, k_cache, v_cache, self, layer.scale, layer.window, layer.softcap, layer.chunk,
                               layer.sinks)

    def decode_mask(self, window: int | None, chunk: int | None) -> torch.Tensor:
        if chunk is None:
            return self.decode_masks[window]
        if (window, chunk) not in self.chunked_masks:
            key_pos = torch.arange(self.decode_blocks.shape[1] * self.block_size)[None, :]
            mask = key_mask(self.decode_lens[:, None] - 1, key_pos, window, chunk)
            self.chunked_masks[window, chunk] = to_device(mask[:, None, None, :], self.decode_blocks.device)
        return self.chunked_masks[window, chunk]


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def __init__(self, block_size: int, windows: tuple[int | None, ...], device: torch.device):
        self.block_size, self.windows, self.device = block_size, windows, device

    def prepare(self, query_lens, computed_lens, block_tables) -> AttentionBatch:
        return build_attention_batch(query_lens, computed_lens, block_tables, self.block_size, self.windows,
                                     self.device)


def build_attention_batch(
    query_lens: list[int],
    computed_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    windows: tuple[int | None, ...],
    device: torch.device,
) -> AttentionBatch:
    """Index tensors for one step. `computed_lens[i]` tokens of sequence i are already in its cache;
    `windows`: the distinct attention windows of the model's layers (None: full attention)."""
    prefills: list[PrefillSlice] = []
    decode_idx: list[int] = []
    decode_lens: list[int] = []
    decode_tables: list[list[int]] = []
    start = 0
    for q_len, done, table in zip(query_lens, computed_lens, block_tables):
        ctx_len = done + q_len
        num_blocks = -(-ctx_len // block_size)
        if q_len == 1 and done > 0:
            decode_idx.append(start)
            decode_lens.append(ctx_len)
            decode_tables.append(table[:num_blocks])
        else:
            add_prefill(prefills, start, q_len, done, table[:num_blocks], device)
        start += q_len

    decode_token_idx = decode_blocks = decode_masks = lens = None
    if decode_idx:
        width = max(len(t) for t in decode_tables)
        decode_blocks = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long)
        lens = torch.tensor(decode_lens)
        key_pos = torch.arange(width * block_size)[None, :]
        decode_masks = {}
        for window in windows:
            # The decode query sits at position len-1.
            decode_masks[window] = to_device(key_mask(lens[:, None] - 1, key_pos, window)[:, None, None, :], device)
        decode_token_idx = tensor_on(decode_idx, torch.long, device)
        decode_blocks = to_device(decode_blocks, device)

    positions, slots = positions_and_slots(query_lens, computed_lens, block_tables, block_size)
    return AttentionBatch(
        positions=to_device(positions, device),
        slot_mapping=to_device(slots, device),
        prefills=prefills,
        decode_token_idx=decode_token_idx,
        decode_blocks=decode_blocks,
        decode_masks=decode_masks,
        decode_lens=lens,
        block_size=block_size,
    )


def add_prefill(prefills: list[PrefillSlice], start: int, q_len: int, done: int, blocks: list[int],
                device: torch.device) -> None:
    """Append a sequence running `q_len` query tokens after `done` cached ones, from flat row `start`; a
    fresh prompt of the same length as the fresh one before it joins that one's batched call."""
    # A fresh prefill attends only to its own new K/V (a window only masks some): no gather needed.
    whole = done == 0
    last = prefills[-1] if prefills else None
    if (whole and last is not None and last.context_blocks is None and last.query_len == q_len
            and last.token_start + last.count * q_len == start):
        last.count += 1
    else:
        context_blocks = None if whole else tensor_on(blocks, torch.long, device)
        prefills.append(PrefillSlice(start, q_len, done + q_len, context_blocks))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    chunk: int | None = None,
    sinks: tuple[float, ...] | None = None,
) -> torch.Tensor:
    """Write the new K/V into the cache, then attend each query token to its sequence's context.
    `softcap`: scores become tanh(s / softcap) * softcap before the mask (Gemma 2); `chunk`: keys only
    in the query's own chunk of positions (Llama 4); `sinks`: a logit per query head in every softmax's
    denominator (gpt-oss)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    write_new_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = attend_prefills(q, k, v, k_cache, v_cache, batch.prefills, scale, sliding_window, softcap, chunk, sinks)
    if batch.decode_token_idx is not None:
        qd = q[batch.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
        # Whole blocks are gathered (contiguous copies), then viewed as one padded context per sequence.
        b = batch.decode_blocks.shape[0]
        kd = k_cache.index_select(0, batch.decode_blocks.flatten()).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache.index_select(0, batch.decode_blocks.flatten()).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        o = _attend(qd, kd, vd, batch.decode_mask(sliding_window, chunk), scale, softcap, sinks)
        out[batch.decode_token_idx] = o.squeeze(2)
    return out


def attend_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    prefills: list[PrefillSlice], scale: float, sliding_window: int | None,
                    softcap: float | None, chunk: int | None = None,
                    sinks: tuple[float, ...] | None = None) -> torch.Tensor:
    """The output rows of the step's prefill slices with SDPA (their new K/V already in the cache): a new
    [T, H, D] tensor whose other rows are for the caller to fill, or, when fresh prompts fill the whole
    batch, their output itself (no copy: a prefill's 16 MB a layer)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    out = torch.empty_like(q)  # untouched (no pages faulted in) when the loop returns early
    for p in prefills:
        rows = slice(p.token_start, p.token_start + p.count * p.query_len)
        qs = q[rows].unflatten(0, (p.count, p.query_len)).transpose(1, 2)  # [n, H, q, D]
        if p.context_blocks is None:
            ks, vs = k[rows], v[rows]
        else:
            ks = k_cache.index_select(0, p.context_blocks).view(-1, num_kv_heads, head_dim)[: p.context_len]
            vs = v_cache.index_select(0, p.context_blocks).view(-1, num_kv_heads, head_dim)[: p.context_len]
        ks = ks.unflatten(0, (p.count, -1)).transpose(1, 2)
        vs = vs.unflatten(0, (p.count, -1)).transpose(1, 2)
        o = _attend_run(qs, ks, vs, p.context_len, scale, sliding_window, softcap, chunk, sinks)
        o = o.transpose(1, 2).flatten(0, 1)
        if o.shape[0] == q.shape[0]:
            return o
        out[rows] = o
    return out


def _attend_run(q, k, v, context_len: int, scale: float, window: int | None, softcap: float | None,
                chunk: int | None, sinks: tuple[float, ...] | None = None) -> torch.Tensor:
    """q [B, H, Q, D], the queries at the last Q of `context_len` positions, over k, v [B, KVH, context_len, D].
    A chunked layer attends chunk by chunk, each query's keys its own chunk's: a fresh prompt of T tokens
    costs T x chunk score pairs and no [T, T] mask."""
    query_len = q.shape[2]
    if chunk is None:
        return _attend(q, k, v, _prefill_mask(query_len, context_len, window, q.device), scale, softcap, sinks)
    first = context_len - query_len
    outs = []
    start = first
    while start < context_len:
        chunk_start = start // chunk * chunk
        end = min(chunk_start + chunk, context_len)
        mask = _prefill_mask(end - start, end - chunk_start, window, q.device)
        outs.append(_attend(q[:, :, start - first : end - first], k[:, :, chunk_start:end], v[:, :, chunk_start:end],
                            mask, scale, softcap, sinks))
        start = end
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None,
            sinks: tuple[float, ...] | None = None) -> torch.Tensor:
    """q [B, H, Q, D] over k, v [B, KVH, K, D]; `mask` True where a key may be attended, None: causal."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    # No fused kernel caps scores or takes sinks: the scores are materialized (as transformers' eager path
    # does), a few query rows at a time so that a long prompt's scores never exist all at once.
    dtype, groups = v.dtype, q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if sinks is not None:
        # Scores in float32, as fused kernels and tandem's C kernel keep them: bfloat16 scores put gpt-oss's
        # logprobs 1.5x further from float32 than transformers' own bfloat16 (test_bfloat16), 1.1x this way.
        q, k, v = q.float(), k.float(), v.float()
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    rows = max(1, SCORES_PER_PASS // (q.shape[0] * q.shape[1] * k.shape[2]))
    out = torch.cat([_attend_rows(q[:, :, i : i + rows], k, v, mask[..., i : i + rows, :], scale, softcap, sinks)
                     for i in range(0, q.shape[2], rows)], dim=2)
    return out.to(dtype)


SCORES_PER_PASS = 1 << 25  # scores materialized at once (128 MiB in float32): a query row is never split


def _attend_rows(q, k, v, mask: torch.Tensor, scale: float, softcap: float | None,
                 sinks: tuple[float, ...] | None) -> torch.Tensor:
    """Some query rows over all their keys, with the scores materialized (k and v have q's heads)."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ v
    # The sink is one more column of each row's softmax whose weight is then dropped: the keys' weights sum
    # to less than 1.
    sink = sink_logits(sinks, q.device).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def _prefill_mask(query_len: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """Causal mask for queries at the last `query_len` positions of the context; None = plain causal."""
    if query_len == context_len and sliding_window is None:
        return None
    q_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    return key_mask(q_pos, torch.arange(context_len, device=device)[None, :], sliding_window)


def key_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, chunk: int | None = None) -> torch.Tensor:
    """True where a query at `q_pos` may attend a key at `k_pos` (broadcast): at or before it, within
    `window` positions of it (itself included), and in its own chunk of `chunk` positions."""
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if chunk is not None:
        mask &= k_pos >= q_pos.div(chunk, rounding_mode="floor") * chunk
    return mask
