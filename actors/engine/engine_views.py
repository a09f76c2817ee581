"""What an `Engine` tells others about its KV cache and model: load reports for the scheduler, the cache
tensors and block sizes for the KV transport, the decoder's shape for cost models and benchmarks.

A base class of `Engine` (engine.py), as `Disaggregation` is: every method only reads what the engine owns
(`runner`, `kv`, `batcher`); nothing here changes a request, a sequence or a block.
"""

from __future__ import annotations

import torch

from actors.engine.outputs import EngineLoad


class EngineViews:
    def load(self) -> EngineLoad:
        running, waiting = self.batcher.load()
        pool = self.kv.pool
        return EngineLoad(pool.num_free_blocks, pool.num_blocks, pool.num_used_blocks, running, waiting,
                          self.batcher.queued_prefill_tokens(), self.batcher.num_preemptions)

    @property
    def num_used_blocks(self) -> int:
        return self.kv.pool.num_used_blocks

    @property
    def model_config(self):
        """The decoder's shape (layers, heads, sizes), for cost models and benchmarks."""
        return self.runner.cfg

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def prompts_pending(self) -> bool:
        """Some request still has prompt tokens to compute (waiting, or mid-prefill)."""
        return self.batcher.queued_prefill_tokens() > 0

    @property
    def kv_caches(self):
        """The cache tensors, for the KV transport to read and write pages (never to allocate blocks)."""
        return self.runner.kv_caches

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_kv_blocks

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block in this process (a tensor-parallel rank's share of the model's)."""
        return self.runner.bytes_per_block

    @property
    def model_bytes_per_block(self) -> int:
        """KV bytes of one block of the whole model (every rank's heads; a replicated head once)."""
        total, by_rank = self.kv_heads
        return self.bytes_per_block * total // (by_rank[0][1] - by_rank[0][0])

    @property
    def kv_heads(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """The model's KV head count, and which of them ([first, end)) each tensor-parallel rank's cache holds."""
        return self.runner.model.total_kv_heads, self.runner.model.kv_heads_by_rank
