"""Decode forwards replayed from CUDA graphs, one graph per batch-size bucket.

A decode step on a GPU is dominated by launching hundreds of small kernels from Python, not by the
kernels (tests/gpu measured the forward flat from batch 1 to 32). A graph launches them all at once. A
step of B sequences is padded to the smallest bucket >= B (`pad_decode`): each padding row decodes
token 0 at position 1 of `pad_block`, a KV block the block pool never hands out (the runner allocates
it beyond the pool's blocks), so padding writes nowhere a sequence reads and its logits are dropped.

Captured once, after the KV cache is allocated (the graphs' memory pool comes out of what is left, and
its size is logged and kept in `memory_bytes`). Prefill and mixed steps stay eager, as do decode steps
larger than the largest bucket or with a context longer than the graphs' page tables. Graphs need a
backend whose decode step keeps its tensors in fixed buffers (`graph_step`: flashinfer, triton) serving
every layer; on CPU there is nothing to capture and the runner logs that it skipped them.

`graph_buckets`, `bucket_for` and `pad_decode` are pure and run on CPU in tests (padded rows leave the
real rows' logits equal); capture and replay run in tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from actors.engine.model.host_to_device import copy_into

log = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 below max_num_seqs, and max_num_seqs."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


def bucket_for(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `batch_size` sequences; None when none does."""
    return next((b for b in buckets if b >= batch_size), None)


@dataclass(frozen=True)
class PaddedDecode:
    token_ids: list[int]
    computed_lens: list[int]
    block_tables: list[list[int]]
    real: int  # the first `real` rows are the step's sequences

    @property
    def query_lens(self) -> list[int]:
        return [1] * len(self.token_ids)


def pad_decode(token_ids: list[int], computed_lens: list[int], block_tables: list[list[int]], bucket: int,
               pad_block: int) -> PaddedDecode:
    """The decode step padded to `bucket` rows (see the module docstring)."""
    if len(token_ids) > bucket:
        raise ValueError(f"{len(token_ids)} sequences do not fit a bucket of {bucket}")
    extra = bucket - len(token_ids)
    return PaddedDecode(list(token_ids) + [0] * extra, list(computed_lens) + [1] * extra,
                        list(block_tables) + [[pad_block]] * extra, len(token_ids))


class DecodeGraphs:
    """The captured graphs and their fixed inputs and outputs; the runner owns one on CUDA."""

    def __init__(self, model, kv_caches, backend, buckets: tuple[int, ...], max_pages_per_seq: int,
                 pad_block: int, device: torch.device):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.buckets, self.max_pages, self.pad_block, self.device = buckets, max_pages_per_seq, pad_block, device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, object, torch.Tensor]] = {}
        self.memory_bytes = 0
        self.replays = 0  # decode steps served from a graph (the GPU checks count them)

    @torch.inference_mode()
    def capture(self) -> None:
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in sorted(self.buckets, reverse=True):  # the largest first: smaller ones reuse its pool
            input_ids = torch.zeros(bucket, dtype=torch.long, device=self.device)
            sample_idx = torch.arange(bucket, device=self.device)
            step = self.backend.graph_step(bucket, self.max_pages)
            padded = pad_decode([], [], [], bucket, self.pad_block)
            step.plan(padded.query_lens, padded.computed_lens, padded.block_tables)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy initialisation must not happen during capture
                    self.model(input_ids, step, self.kv_caches, sample_idx)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self.model(input_ids, step, self.kv_caches, sample_idx)
            self._graphs[bucket] = (graph, input_ids, step, logits)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured decode CUDA graphs for batch sizes %s (%.1f MiB)", self.buckets, self.memory_bytes / 2**20)

    def run(self, token_ids: list[int], computed_lens: list[int], block_tables: list[list[int]],
            feed=None) -> torch.Tensor | None:
        """Logits [B, vocab] of a decode step replayed from its bucket's graph; None when it needs the eager
        path (no bucket fits, or a context outgrows the captured page tables). `feed`: the runner's
        TokenFeed of input ids still on the device."""
        bucket = bucket_for(len(token_ids), self.buckets)
        if bucket is None or any(-(-(done + 1) // self.backend.block_size) > self.max_pages for done in computed_lens):
            return None
        graph, input_ids, step, logits = self._graphs[bucket]
        padded = pad_decode(token_ids, computed_lens, block_tables, bucket, self.pad_block)
        copy_into(input_ids, torch.tensor(padded.token_ids, dtype=torch.long))
        if feed is not None:
            feed.write_into(input_ids)
        step.plan(padded.query_lens, padded.computed_lens, padded.block_tables)
        graph.replay()
        self.replays += 1
        return logits[: padded.real]
