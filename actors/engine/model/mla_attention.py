"""Multi-head latent attention (DeepSeek-V2/V3, deepseek.py) over a paged cache of latents.

The page: each token of each layer caches one row of `kv_lora_rank + qk_rope_head_dim` values (its
normalized latent, then its rotated key), shared by every head. So that the page format, the block pool
and the handoff (kv_transfer/) carry it as they carry any page, the row is stored as a one-"head" K/V
pair: its first half in the layer's K tensor, its second half in V (`latent_page_width` values each).
A token then costs layers x (kv_lora_rank + rope) x dtype bytes, where MHA keeps 2 x layers x heads x
head_dim: 576 against 32,768 values a layer at DeepSeek-V3's size.

Two ways to attend, the same scores:
- plain: expand the context's latents with `kv_b` into every head's key and value, then attend as MHA;
- absorbed: fold kv_b's key half into the query (q_nope @ W_uk: a query in latent space) and its value
  half into the output; attention is then multi-query attention over the cached rows themselves, with
  no per-token expansion.
Plain costs about L x rank x H x (nope + v) to expand a context of L tokens, absorbed about
q x H x (rank + rope) x L for q queries over it: absorbed wins below q = rank x (nope + v) / (rank + rope)
queries (227 at DeepSeek-V3's widths), and `absorbs` picks so. Measured on this box (one thread, 16
heads of DeepSeek-V3's widths, `_plain` vs `_absorbed`): 8 decodes over 2,048 tokens 2,408 vs 35 ms;
64 queries over 2,048: 157 vs 62 ms; 256 over 2,048: 273 vs 313 ms; a 1,024-token prompt: 815 vs 1,706 ms.

The step's tables come from the `sdpa` backend's `AttentionBatch` (the runner picks it for MLA models).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.model.attention import AttentionBatch, _attend, _prefill_mask


@dataclass(frozen=True)
class LatentWeights:
    """A layer's `kv_b` [heads * (nope + v), rank] and how it splits."""

    kv_b: torch.Tensor
    num_heads: int
    nope: int
    v_dim: int

    @property
    def key(self) -> torch.Tensor:  # [H, nope, rank]
        return self.kv_b.view(self.num_heads, self.nope + self.v_dim, -1)[:, : self.nope]

    @property
    def value(self) -> torch.Tensor:  # [H, v, rank]
        return self.kv_b.view(self.num_heads, self.nope + self.v_dim, -1)[:, self.nope :]


def latent_page_width(kv_lora_rank: int, rope_dim: int) -> int:
    """The width of each of a layer's K and V cache tensors: half a latent row."""
    if (kv_lora_rank + rope_dim) % 2:
        raise ValueError(f"kv_lora_rank + qk_rope_head_dim = {kv_lora_rank + rope_dim} is odd: tandem's MLA page "
                         "splits a latent row into two equal halves")
    return (kv_lora_rank + rope_dim) // 2


def write_latent(latent: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    half = k_cache.shape[-1]
    k_cache.view(-1, half).index_copy_(0, slots, latent[:, :half])
    v_cache.view(-1, half).index_copy_(0, slots, latent[:, half:])


def read_latent(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The latent rows of `blocks`, in order: [len(blocks) * block_size, kv_lora_rank + rope]."""
    return torch.cat([k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)], dim=-1).flatten(0, 2)


def attend_latent(step: AttentionBatch, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  kv_cache: tuple[torch.Tensor, torch.Tensor], w: LatentWeights, scale: float) -> torch.Tensor:
    """Write the step's latents [T, rank + rope] into the cache, then attend q (q_nope [T, H, nope], q_pe
    [T, H, rope], rotated) to each sequence's context; returns [T, H, v]."""
    assert isinstance(step, AttentionBatch), "MLA attends over the sdpa backend's step"
    k_cache, v_cache = kv_cache
    write_latent(latent, k_cache, v_cache, step.slot_mapping)
    tokens, width = latent.shape
    out = q_nope.new_empty(tokens, w.num_heads, w.v_dim)
    for p in step.prefills:
        rows = slice(p.token_start, p.token_start + p.count * p.query_len)
        if p.context_blocks is None:
            context = latent[rows].view(p.count, p.query_len, width)
        else:
            context = read_latent(k_cache, v_cache, p.context_blocks)[: p.context_len].unsqueeze(0)
        mask = _prefill_mask(p.query_len, p.context_len, None, latent.device)
        shape = (p.count, p.query_len)
        attend = _absorbed if absorbs(p.query_len, w, width) else _plain
        o = attend(q_nope[rows].unflatten(0, shape), q_pe[rows].unflatten(0, shape), context, mask, w, scale)
        if o.shape[0] * o.shape[1] == tokens:
            return o.flatten(0, 1)
        out[rows] = o.flatten(0, 1)
    if step.decode_token_idx is not None:
        idx = step.decode_token_idx
        context = read_latent(k_cache, v_cache, step.decode_blocks.flatten()).view(len(idx), -1, width)
        out[idx] = _absorbed(q_nope[idx, None], q_pe[idx, None], context, step.decode_masks[None], w, scale)[:, 0]
    return out


def absorbs(query_len: int, w: LatentWeights, width: int) -> bool:
    """Whether a run of `query_len` queries attends absorbed (cheaper below the crossover; the module)."""
    rank = w.kv_b.shape[1]
    return query_len * width < rank * (w.nope + w.v_dim)


def _plain(q_nope, q_pe, context, mask, w: LatentWeights, scale: float) -> torch.Tensor:
    """q [n, q, H, *] over context rows [n, L, rank + rope] expanded into each head's key and value."""
    n, length = context.shape[:2]
    rope = q_pe.shape[-1]
    latent, k_pe = context.split([context.shape[-1] - rope, rope], dim=-1)
    k_nope, v = (latent @ w.kv_b.T).view(n, length, w.num_heads, -1).split([w.nope, w.v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None].expand(n, length, w.num_heads, rope)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    return _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, None).transpose(1, 2)


def _absorbed(q_nope, q_pe, context, mask, w: LatentWeights, scale: float) -> torch.Tensor:
    """The same attention as `_plain` with kv_b folded into the query and the output: multi-query
    attention of q [n, q, H, rank + rope] over the context rows [n, L, rank + rope] as they are cached.
    Every head reads the same rows, so the heads are rows of one matmul: SDPA's CPU path took ~60x as long
    on DeepSeek's widths (576-wide keys, 512-wide values; 8 decodes of 2,048 tokens, 16 heads, one thread).
    `mask`: [q, L] or [n, 1, 1, L], True where a key may be attended; None: causal."""
    n, q_len, heads = q_nope.shape[:3]
    q = torch.cat([torch.einsum("nqhd,hdr->nqhr", q_nope, w.key), q_pe], dim=-1)
    scores = torch.bmm(q.flatten(1, 2), context.transpose(1, 2)).view(n, q_len, heads, -1).mul_(scale)
    if mask is None:
        length = context.shape[1]
        mask = torch.ones(q_len, length, dtype=torch.bool, device=q.device).tril(length - q_len)
    if mask.dim() == 2:
        mask = mask[:, None]  # one mask row per query position, every head alike
    probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(context.dtype)
    o = torch.bmm(probs.flatten(1, 2), context[..., : w.kv_b.shape[1]]).view(n, q_len, heads, -1)
    return torch.einsum("nqhr,hvr->nqhv", o, w.value)
