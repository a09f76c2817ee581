"""The `cpu` attention backend: every query attends with tandem's CPU kernels (cpu_kernel.py), which read
K/V in their cache blocks: decode tokens and runs of up to KERNEL_MAX_QUERY tokens after a cached context
with the decode kernel (csrc/paged_attention_cpu.c), prompts and longer chunks with the prefill kernel
(csrc/prefill_attention_cpu.c). The reference path (attention.py, SDPA) stays the `sdpa` backend.

Why: the reference path gathers each decode sequence's blocks into a padded copy per layer and step; at
16 sequences of 2,048 tokens that copy was ~1.5 GB a step on SmolLM2 before any arithmetic. For prompts,
SDPA's CPU flash attention took 1.7x the prefill kernel's time at 512 tokens of SmolLM2 (one thread,
both dtypes) and 1.1-1.2x at 2,048 or a 256-token chunk after 1,024 cached (a third of a 512-token
prefill's time was SDPA). Measured on this 2-core box, one thread, SmolLM2's heads, 8 sequences at 2,000
tokens of context: the decode kernel took 0.55x SDPA's time for runs of 4 tokens and 0.1-0.4x for decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.model import cpu_kernel
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
class KernelRuns:
    """The sequences one kernel attends in a step (see cpu_kernel.paged_attention)."""

    block_tables: torch.Tensor  # int32 [S, max_blocks]
    query_starts: torch.Tensor  # int64 [S]
    query_lens: torch.Tensor
    context_lens: torch.Tensor

    @classmethod
    def of(cls, starts: list[int], lens: list[int], contexts: list[int], tables: list[list[int]]) -> KernelRuns | None:
        if not tables:
            return None
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return cls(padded, torch.tensor(starts), torch.tensor(lens), torch.tensor(contexts))


@dataclass
class CpuPagedStep(StepAttention):
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    short: KernelRuns | None  # decodes and short runs after a cached context (the decode kernel)
    long: KernelRuns | None  # prompts and longer chunks (the prefill kernel)

    def attend(self, q, k, v, k_cache, v_cache, layer: LayerAttention) -> torch.Tensor:
        write_new_kv(k, v, k_cache, v_cache, self.slot_mapping)
        q = q.contiguous()
        out = torch.empty_like(q)  # every row is some sequence's: one of the kernels writes it
        sinks = None if layer.sinks is None else sink_logits(layer.sinks, q.device)
        for runs, kernel in ((self.short, cpu_kernel.paged_attention), (self.long, cpu_kernel.prefill_attention)):
            if runs is not None:
                kernel(out, q, k_cache, v_cache, runs.block_tables, runs.query_starts, runs.query_lens,
                       runs.context_lens, layer.scale, layer.window, layer.softcap, layer.chunk, sinks)
        return out


class CpuPagedBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, block_size: int):
        self.block_size = block_size

    def prepare(self, query_lens, computed_lens, block_tables) -> CpuPagedStep:
        runs: dict[bool, tuple[list, list, list, list]] = {False: ([], [], [], []), True: ([], [], [], [])}
        start = 0
        for q_len, done, table in zip(query_lens, computed_lens, block_tables):
            starts, lens, contexts, tables = runs[done == 0 or q_len > KERNEL_MAX_QUERY]
            starts.append(start)
            lens.append(q_len)
            contexts.append(done + q_len)
            tables.append(table[: -(-(done + q_len) // self.block_size)])
            start += q_len
        positions, slots = positions_and_slots(query_lens, computed_lens, block_tables, self.block_size)
        return CpuPagedStep(positions, slots, KernelRuns.of(*runs[False]), KernelRuns.of(*runs[True]))
