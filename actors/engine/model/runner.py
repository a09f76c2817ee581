"""Owns the model weights and the paged KV cache tensors; turns a scheduled batch into logits."""

from __future__ import annotations

import torch

from actors.engine.model.attention import build_attention_batch
from actors.engine.model.cpu_linear import mkl_packing_available, pack_linears
from actors.engine.model.llama import LlamaModel
from actors.engine.model.loader import DTYPES, load_model


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str, device: str, block_size: int,
                 num_kv_blocks: int | None, kv_cache_memory_bytes: int, max_model_len: int | None = None):
        self.device = torch.device(device)
        self.model: LlamaModel = load_model(model_dir, dtype, self.device, context_len=max_model_len)
        self.cfg = self.model.cfg
        self.block_size = block_size
        self.dtype = DTYPES[dtype]
        if mkl_packing_available(self.device, self.dtype):
            pack_linears(self.model)
        if num_kv_blocks is None:
            num_kv_blocks = max(1, kv_cache_memory_bytes // self.bytes_per_block)
        self.num_kv_blocks = num_kv_blocks
        shape = (num_kv_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.cfg.num_layers)
        ]

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    @torch.inference_mode()
    def execute(
        self,
        token_ids: list[int],
        query_lens: list[int],
        computed_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Forward the flat batch; return float32 logits [len(sample_rows), vocab] for the sampled sequences.

        `sample_rows` are indexes into the batch's sequences; each samples at its last query token.
        """
        batch = build_attention_batch(
            query_lens, computed_lens, block_tables, self.block_size, self.model.windows, self.device
        )
        ends = torch.tensor(query_lens).cumsum(0) - 1
        sample_idx = ends[torch.tensor(sample_rows, dtype=torch.long)].to(self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.model(input_ids, batch, self.kv_caches, sample_idx)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        for k, v in self.kv_caches:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
