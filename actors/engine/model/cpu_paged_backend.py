"""The `cpu` attention backend: decode tokens (and runs of up to KERNEL_MAX_QUERY tokens after a cached
context) attend with tandem's CPU kernel (cpu_kernel.py), which reads K/V in their cache blocks; prompts
and longer chunks attend with SDPA as in the reference path. Measured on this 2-core box, one thread,
SmolLM2's heads, 8 sequences at 2,000 tokens of context: the kernel took 0.55x SDPA's time for runs of
4 tokens, about the same for 8 to 16 and 1.6-4x for 64 (SDPA's blocked matmuls win once a K/V row serves
enough queries to pay for the gather); for decodes it took 0.1-0.4x.

Why: the reference path gathers each decode sequence's blocks into a padded copy per layer and step; at
16 sequences of 2,048 tokens that copy was ~1.5 GB a step on SmolLM2 before any arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.model import cpu_kernel
from actors.engine.model.attention import PrefillSlice, add_prefill, attend_prefills
from actors.engine.model.attention_backend import (
    AttentionBackend, LayerAttention, StepAttention, positions_and_slots, sink_logits, write_new_kv,
)

KERNEL_MAX_QUERY = 4
MAX_HEAD_DIM = 256  # the kernel's limits (csrc/paged_attention_cpu.c)
HEAD_DIM_MULTIPLE = 16
MAX_HEADS_PER_KV_HEAD = 64


def why_not_cpu(layers: tuple[LayerAttention, ...], dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the CPU kernel cannot attend this model here, or None."""
    if device.type != "cpu":
        return f"it runs on the CPU, this engine runs on {device.type}"
    for layer in layers:
        if (layer.head_dim > MAX_HEAD_DIM or layer.head_dim % HEAD_DIM_MULTIPLE
                or layer.num_heads // layer.num_kv_heads > MAX_HEADS_PER_KV_HEAD):
            return (f"a layer has head_dim {layer.head_dim} and {layer.num_heads // layer.num_kv_heads} heads per kv "
                    f"head (the kernel takes a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}, and at most "
                    f"{MAX_HEADS_PER_KV_HEAD})")
    return cpu_kernel.why_unavailable(dtype)


@dataclass
class CpuPagedStep(StepAttention):
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefills: list[PrefillSlice]  # prompts and long chunks (SDPA)
    # The kernel's sequences: decodes and short runs after a cached context; None when there are none.
    block_tables: torch.Tensor | None  # int32 [S, max_blocks]
    query_starts: torch.Tensor | None  # int64 [S]
    query_lens: torch.Tensor | None
    context_lens: torch.Tensor | None

    def attend(self, q, k, v, k_cache, v_cache, layer: LayerAttention) -> torch.Tensor:
        write_new_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.block_tables is None:
            return attend_prefills(q, k, v, k_cache, v_cache, self.prefills, layer.scale, layer.window, layer.softcap,
                                   layer.chunk, layer.sinks)
        q = q.contiguous()
        out = attend_prefills(q, k, v, k_cache, v_cache, self.prefills, layer.scale, layer.window, layer.softcap,
                              layer.chunk, layer.sinks)
        sinks = None if layer.sinks is None else sink_logits(layer.sinks, q.device)
        cpu_kernel.paged_attention(out, q, k_cache, v_cache, self.block_tables, self.query_starts, self.query_lens,
                                   self.context_lens, layer.scale, layer.window, layer.softcap, layer.chunk, sinks)
        return out


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def prepare(self, query_lens, computed_lens, block_tables) -> CpuPagedStep:
        cpu = torch.device("cpu")
        prefills: list[PrefillSlice] = []
        starts, lens, contexts, tables = [], [], [], []
        start = 0
        for q_len, done, table in zip(query_lens, computed_lens, block_tables):
            blocks = table[: -(-(done + q_len) // self.block_size)]
            if done == 0 or q_len > KERNEL_MAX_QUERY:
                add_prefill(prefills, start, q_len, done, blocks, cpu)
            else:
                starts.append(start)
                lens.append(q_len)
                contexts.append(done + q_len)
                tables.append(blocks)
            start += q_len
        positions, slots = positions_and_slots(query_lens, computed_lens, block_tables, self.block_size)
        if not tables:
            return CpuPagedStep(positions, slots, prefills, None, None, None, None)
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return CpuPagedStep(positions, slots, prefills, padded, torch.tensor(starts), torch.tensor(lens),
                            torch.tensor(contexts))
