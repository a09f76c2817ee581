"""The `triton` attention backend: decode steps attend with tandem's own Triton kernel (triton_attention.py),
reading the paged cache through block tables; steps with a prefill chunk attend with SDPA (attention.py),
whose flash kernel already serves a fresh prompt without any gather.

Triton ships with CUDA builds of torch, so this backend needs nothing installed beyond them (FlashInfer
does). Its decode step can be replayed from a CUDA graph: `graph_step` keeps the block tables, context
lengths, positions and slots in fixed buffers that `plan` refills before each replay. On a CPU it runs
only in Triton's interpreter (TRITON_INTERPRET=1), which the CPU tests use to check it end to end.
"""

from __future__ import annotations

import torch

from actors.engine.model.attention import SdpaBackend
from actors.engine.model.attention_backend import (
    GraphableBackend, LayerAttention, StepAttention, positions_and_slots, write_new_kv,
)
from actors.engine.model.host_to_device import copy_into, to_device


class TritonBackend(GraphableBackend):
    name = "triton"

    def __init__(self, block_size: int, windows: tuple[int | None, ...], device: torch.device):
        from actors.engine.model.triton_attention import paged_decode_attention  # noqa: PLC0415 (imports triton)

        self.kernel = paged_decode_attention
        self.block_size, self.device = block_size, device
        self._sdpa = SdpaBackend(block_size, windows, device)

    def prepare(self, query_lens, computed_lens, block_tables) -> StepAttention:
        if not all(q == 1 and done > 0 for q, done in zip(query_lens, computed_lens)):
            return self._sdpa.prepare(query_lens, computed_lens, block_tables)
        step = TritonDecodeStep(self)
        step.plan(query_lens, computed_lens, block_tables)
        return step

    def graph_step(self, batch_size: int, max_pages_per_seq: int) -> TritonDecodeStep:
        step = TritonDecodeStep(self)
        step.positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        step.slot_mapping = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        step.block_tables = torch.zeros(batch_size, max_pages_per_seq, dtype=torch.int32, device=self.device)
        step.seq_lens = torch.zeros(batch_size, dtype=torch.int32, device=self.device)
        step.fixed = True
        return step


class TritonDecodeStep(StepAttention):
    """A decode-only step: every sequence attends one new token to its whole cached context."""

    def __init__(self, backend: TritonBackend):
        self.backend = backend
        self.fixed = False  # True: every tensor is a CUDA graph's input, refilled in place by `plan`
        self.block_tables: torch.Tensor | None = None  # int32 [B, pages]
        self.seq_lens: torch.Tensor | None = None  # int32 [B], the new token included

    def plan(self, query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]]) -> None:
        b = self.backend
        positions, slots = positions_and_slots(query_lens, computed_lens, block_tables, b.block_size)
        lens = [done + 1 for done in computed_lens]
        width = self.block_tables.shape[1] if self.fixed else max(-(-n // b.block_size) for n in lens)
        pages = [-(-n // b.block_size) for n in lens]
        if max(pages) > width:
            raise ValueError(f"a context of {max(lens)} tokens needs {max(pages)} pages; the step holds {width}")
        tables = torch.tensor([t[:p] + [0] * (width - p) for t, p in zip(block_tables, pages)], dtype=torch.int32)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        if self.fixed:
            for buffer, value in ((self.positions, positions), (self.slot_mapping, slots),
                                  (self.block_tables, tables), (self.seq_lens, seq_lens)):
                copy_into(buffer, value)
        else:
            self.positions, self.slot_mapping = to_device(positions, b.device), to_device(slots, b.device)
            self.block_tables, self.seq_lens = to_device(tables, b.device), to_device(seq_lens, b.device)

    def attend(self, q, k, v, k_cache, v_cache, layer: LayerAttention) -> torch.Tensor:
        write_new_kv(k, v, k_cache, v_cache, self.slot_mapping)
        return self.backend.kernel(q, k_cache, v_cache, self.block_tables, self.seq_lens, layer.scale, layer.window,
                                   layer.softcap, layer.chunk)
