"""The `flashinfer` attention backend: FlashInfer's paged kernels on CUDA, reading tandem's block tables
directly (no gather of a sequence's context into a contiguous copy, as the SDPA path does).

tandem's per-layer caches are `[num_blocks, block_size, kv_heads, head_dim]` for K and for V: FlashInfer's
"NHD" layout, passed as a (k, v) pair, so nothing is converted. A step plans one wrapper per distinct
`LayerAttention` (window, scale and cap are plan-time parameters): a decode wrapper when every sequence
runs one token after a cached context, else a prefill wrapper over the whole ragged batch (decode tokens
are sequences of one query token in it; FlashInfer's causal mask aligns each query to the end of its
context). Planning happens on the CPU before the forward; the forward only runs kernels, so a decode
forward can be captured in a CUDA graph (decode_graphs.py) with `graph_step`'s fixed-size buffers.

What FlashInfer does not serve falls back to SDPA per layer (`refusal`): float32 (its kernels take
float16/bfloat16) and head sizes outside its precompiled set. Sliding windows and Gemma 2's score cap
are served (`window_left`, `logits_soft_cap`).

This file imports `flashinfer` only when a backend is built: the CPU build of tandem never needs it.
Not run by the CPU tests (there is no FlashInfer kernel for the CPU); `refusal` and the index arithmetic
(`paged_kv_indexes`) are, and tests/gpu/test_gpu.py checks the kernels against SDPA on a GPU.
"""

from __future__ import annotations

import torch

from actors.engine.model.attention import AttentionBatch, build_attention_batch
from actors.engine.model.attention_backend import (
    GraphableBackend, LayerAttention, StepAttention, positions_and_slots, write_new_kv,
)
from actors.engine.model.host_to_device import copy_into, to_device

SERVED_HEAD_DIMS = (64, 128, 256)  # what flashinfer-jit-cache ships compiled for the paged kernels
SERVED_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 256 << 20


def refusal(layer: LayerAttention, dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot attend `layer` in `dtype`, or None."""
    if dtype not in SERVED_DTYPES:
        return f"{dtype} (FlashInfer's kernels take float16 or bfloat16)"
    if layer.head_dim not in SERVED_HEAD_DIMS:
        return f"head_dim {layer.head_dim} (its precompiled kernels cover {', '.join(map(str, SERVED_HEAD_DIMS))})"
    if layer.num_heads % layer.num_kv_heads:
        return f"{layer.num_heads} query heads over {layer.num_kv_heads} KV heads (not a whole group each)"
    if layer.chunk is not None:
        return f"chunked attention (chunks of {layer.chunk}: its masks are causal windows, not chunks)"
    if layer.sinks is not None:
        return "attention sinks (gpt-oss; tandem does not pass them to FlashInfer yet)"
    return None


def paged_kv_indexes(query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]],
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR view of the step (int32, on the CPU): qo_indptr [B+1], kv_indptr [B+1] (pages per
    sequence, summed), kv_indices (the pages, sequence after sequence), last_page_len [B] (1..block_size)."""
    context = [done + q for done, q in zip(computed_lens, query_lens)]
    pages = [-(-n // block_size) for n in context]
    qo_indptr = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_indices = torch.tensor([b for table, n in zip(block_tables, pages) for b in table[:n]], dtype=torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * block_size for n, p in zip(context, pages)], dtype=torch.int32)
    return qo_indptr, kv_indptr, kv_indices, last_page_len


class FlashInferBackend(GraphableBackend):
    name = "flashinfer"

    def __init__(self, layers: tuple[LayerAttention, ...], windows: tuple[int | None, ...], block_size: int,
                 dtype: torch.dtype, device: torch.device):
        import flashinfer  # noqa: PLC0415 (CUDA machines only)

        self._fi = flashinfer
        self.block_size, self.dtype, self.device, self.windows = block_size, dtype, device, windows
        self.served = tuple(layer for layer in layers if refusal(layer, dtype) is None)
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = {layer: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
                         for layer in self.served}
        self._decode = {layer: self._decode_wrapper(layer) for layer in self.served}

    def refuses(self, layer: LayerAttention) -> str | None:
        return refusal(layer, self.dtype)

    def prepare(self, query_lens, computed_lens, block_tables) -> FlashInferStep:
        decode_only = all(q == 1 and done > 0 for q, done in zip(query_lens, computed_lens))
        step = FlashInferStep(self, self._decode if decode_only else self._prefill, decode_only)
        step.plan(query_lens, computed_lens, block_tables)
        return step

    def graph_step(self, batch_size: int, max_pages_per_seq: int) -> FlashInferStep:
        """A decode step whose every tensor (positions, slots, the wrappers' page tables) has a fixed size
        and address, for a CUDA graph of `batch_size` sequences; `plan` refills it before each replay."""
        def buffer(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        wrappers = {layer: self._decode_wrapper(layer, graph_buffers=(buffer(batch_size + 1),
                                                                      buffer(batch_size * max_pages_per_seq),
                                                                      buffer(batch_size)))
                    for layer in self.served}
        step = FlashInferStep(self, wrappers, decode_only=True)
        step.positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        step.slot_mapping = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        step.fixed = True
        return step

    def _decode_wrapper(self, layer: LayerAttention, graph_buffers=None):
        # Tensor cores pay off once several query heads share a KV head (FlashInfer's own advice).
        group = layer.num_heads // layer.num_kv_heads
        if graph_buffers is None:
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=group >= 4)
        indptr, indices, last_page_len = graph_buffers
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=group >= 4,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last_page_len)


class FlashInferStep(StepAttention):
    def __init__(self, backend: FlashInferBackend, wrappers: dict, decode_only: bool):
        self.backend, self.wrappers, self.decode_only = backend, wrappers, decode_only
        self.fixed = False  # True: positions and slots are a CUDA graph's inputs, refilled in place
        self._lists: tuple[list[int], list[int], list[list[int]]] | None = None
        self._fallback: AttentionBatch | None = None

    def plan(self, query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]]) -> None:
        b = self.backend
        positions, slots = positions_and_slots(query_lens, computed_lens, block_tables, b.block_size)
        if self.fixed:
            copy_into(self.positions, positions)
            copy_into(self.slot_mapping, slots)
        else:
            self.positions, self.slot_mapping = to_device(positions, b.device), to_device(slots, b.device)
        self._lists, self._fallback = (query_lens, computed_lens, block_tables), None
        qo_indptr, kv_indptr, kv_indices, last_page_len = paged_kv_indexes(
            query_lens, computed_lens, block_tables, b.block_size)
        for layer, wrapper in self.wrappers.items():
            common = dict(sm_scale=layer.scale, window_left=-1 if layer.window is None else layer.window - 1,
                          logits_soft_cap=layer.softcap, q_data_type=b.dtype, kv_data_type=b.dtype)
            if self.decode_only:
                wrapper.plan(kv_indptr, kv_indices, last_page_len, layer.num_heads, layer.num_kv_heads,
                             layer.head_dim, b.block_size, **common)
            else:
                wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, layer.num_heads, layer.num_kv_heads,
                             layer.head_dim, b.block_size, causal=True, **common)

    def attend(self, q, k, v, k_cache, v_cache, layer: LayerAttention) -> torch.Tensor:
        wrapper = self.wrappers.get(layer)
        if wrapper is None:
            return self._sdpa().attend(q, k, v, k_cache, v_cache, layer)
        write_new_kv(k, v, k_cache, v_cache, self.slot_mapping)
        return wrapper.run(q, (k_cache, v_cache))

    def _sdpa(self) -> AttentionBatch:
        """The reference batch for the layers FlashInfer refuses, built once per step on first use."""
        if self._fallback is None:
            if self.fixed:
                raise RuntimeError("a CUDA-graph decode step cannot fall back to SDPA: graphs need every layer served")
            b = self.backend
            self._fallback = build_attention_batch(*self._lists, b.block_size, b.windows, b.device)
        return self._fallback
