"""Owns the model weights and the paged KV cache tensors; turns a scheduled batch into logits.

In a tensor-parallel worker every rank has a runner over its shard of the weights and of the KV cache
(its KV heads, the same block ids everywhere): rank 0's runner leads each step (it sends the plan
before running it), the others `follow` until rank 0 says stop.

Attention runs on the backend `backend_choice.py` picks. On CUDA with a graphable backend (flashinfer,
triton) serving every layer and no tensor parallelism, decode steps replay CUDA graphs
(decode_graphs.py); their padding rows write into one extra KV block past the `num_kv_blocks` the
engine's block pool hands out (`kv_caches` are views of the first `num_kv_blocks`, so nothing else
sees that block).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from actors.engine.model.attention_backend import GraphableBackend
from actors.engine.model.backend_choice import choose_attention_backend, installed
from actors.engine.model.cpu_allocator import keep_freed_memory, zeros_on_huge_pages
from actors.engine.model.cpu_linear import linear_packing, pack_linears
from actors.engine.model.decode_graphs import DecodeGraphs, graph_buckets
from actors.engine.model.dtype_choice import resolve_dtype
from actors.engine.model.host_to_device import tensor_on, to_device
from actors.engine.model.llama import LlamaModel
from actors.engine.model.loader import DTYPES, load_model, read_hf_config
from actors.engine.model.parallel import SINGLE, StepPlan, TPComm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenFeed:
    """Input ids a step still in flight sampled (overlapped steps, engine.py): flat token `positions[i]`
    of this step takes `source[rows[i]]`, where `source` (the previous step's chosen tokens) lives on the
    model's device, so the host never waits for them."""

    positions: list[int]
    rows: list[int]
    source: torch.Tensor

    def write_into(self, input_ids: torch.Tensor) -> None:
        device = input_ids.device
        input_ids[tensor_on(self.positions, torch.long, device)] = self.source[tensor_on(self.rows, torch.long, device)]


class ModelRunner:
    def __init__(self, model_dir: str, dtype: str, device: str, block_size: int,
                 num_kv_blocks: int | None, kv_cache_memory_bytes: int, max_model_len: int | None = None,
                 comm: TPComm = SINGLE, attention_backend: str = "auto", cuda_graphs: bool = True,
                 max_num_seqs: int = 64, fused_kernels: bool = True):
        self.device = torch.device(device)
        self.comm = comm
        self._led_at = time.monotonic()  # when rank 0 last sent its followers a plan
        dtype = resolve_dtype(dtype, self.device.type, read_hf_config(model_dir).get("model_type"))
        self.model: LlamaModel = load_model(model_dir, dtype, self.device, context_len=max_model_len, shard=comm.shard)
        self.model.attach(comm)
        self.cfg = self.model.cfg
        self.block_size = block_size
        self.dtype = DTYPES[dtype]
        if packing := linear_packing(self.device, self.dtype):
            pack_linears(self.model, packing)
        if self.device.type == "cpu":
            keep_freed_memory()
        elif fused_kernels and self.device.type == "cuda" and installed("triton"):
            from actors.engine.model import triton_fused  # noqa: PLC0415 (imports triton)

            self.model.use_fused_kernels(triton_fused)
        if num_kv_blocks is None:
            num_kv_blocks = max(1, kv_cache_memory_bytes // self.bytes_per_block)
        self.num_kv_blocks = num_kv_blocks
        if getattr(self.model, "latent_attention", False):  # MLA attends over the sdpa step's tables
            if attention_backend not in ("auto", "sdpa"):
                raise ValueError(f"engine attention_backend={attention_backend!r}: latent attention (DeepSeek) runs "
                                 "on 'sdpa' (or 'auto')")
            attention_backend = "sdpa"
        self.attention = choose_attention_backend(attention_backend, self.model.layer_attentions(), self.model.windows,
                                                  block_size, self.dtype, self.device)
        graphs = self._graphs_wanted(cuda_graphs)
        shape = (num_kv_blocks + graphs, block_size, *self.model.kv_cache_layout)
        # The model's caches (with the graphs' padding block, if any) and everyone else's view of them.
        self._caches = [
            (self._cache_tensor(shape), self._cache_tensor(shape))
            for _ in range(self.cfg.num_layers)
        ]
        self.kv_caches = [(k[:num_kv_blocks], v[:num_kv_blocks]) for k, v in self._caches]
        self.graphs: DecodeGraphs | None = None
        if graphs:
            context = max_model_len or self.cfg.max_position_embeddings
            self.graphs = DecodeGraphs(self.model, self._caches, self.attention, graph_buckets(max_num_seqs),
                                       -(-context // block_size), num_kv_blocks, self.device)
            self.graphs.capture()

    def _cache_tensor(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return zeros_on_huge_pages(shape, self.dtype)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @classmethod
    def from_config(cls, config, comm: TPComm = SINGLE) -> ModelRunner:
        """The runner an engine of `config` (an EngineConfig) uses; every rank of a tensor-parallel worker
        builds its own from the same config, so their caches have the same blocks."""
        return cls(config.model, config.dtype, config.device, config.block_size, config.num_kv_blocks,
                   config.kv_cache_memory_bytes, config.max_model_len, comm, config.attention_backend,
                   config.cuda_graphs, config.max_num_seqs, config.fused_kernels)

    def _graphs_wanted(self, enabled: bool) -> bool:
        """Whether decode steps run from CUDA graphs; says why not when they were asked for."""
        if not enabled:
            return False
        if self.device.type != "cuda":
            log.info("CUDA graphs skipped: this engine runs on %s (decode steps run eagerly)", self.device.type)
            return False
        if self.comm.shard.size > 1:
            log.info("CUDA graphs skipped: the decode step all-reduces across %d tensor-parallel ranks", self.comm.shard.size)
            return False
        refused = [why for layer in self.model.layer_attentions() if (why := self.attention.refuses(layer))]
        if not isinstance(self.attention, GraphableBackend) or refused:
            log.info("CUDA graphs skipped: they need the flashinfer or triton attention backend on every layer (%s)",
                     refused[0] if refused else f"attention runs on {self.attention.name}")
            return False
        return True

    @property
    def bytes_per_block(self) -> int:
        heads, head_dim = self.model.kv_cache_layout
        per_token = 2 * self.cfg.num_layers * heads * head_dim * self.dtype.itemsize
        return per_token * self.block_size

    @torch.inference_mode()
    def execute(
        self,
        token_ids: list[int],
        query_lens: list[int],
        computed_lens: list[int],
        block_tables: list[list[int]],
        sample_rows: list[int],
        score_rows: list[int] = (),
        feed: TokenFeed | None = None,
    ) -> torch.Tensor:
        """Forward the flat batch; return float32 logits [len(sample_rows) + len(score_rows), vocab]: first
        for the sampled sequences, then for the scored tokens.

        `sample_rows` are indexes into the batch's sequences; each samples at its last query token.
        `score_rows` are indexes into the flat tokens whose logits are wanted too (prompt logprobs).
        `feed`: input ids the previous step sampled and the host does not know yet (their entries in
        `token_ids` are placeholders); not across tensor-parallel ranks, which get their ids from the plan.
        """
        if feed is not None and self.comm.shard.size > 1:
            raise ValueError("a tensor-parallel step takes its input ids from the host (no TokenFeed)")
        self._lead(StepPlan("forward", token_ids, query_lens, computed_lens, block_tables, sample_rows,
                            score_rows=list(score_rows)))
        return self._forward(token_ids, query_lens, computed_lens, block_tables, sample_rows, score_rows, feed)

    def _forward(self, token_ids, query_lens, computed_lens, block_tables, sample_rows, score_rows=(),
                 feed: TokenFeed | None = None) -> torch.Tensor:
        if self.graphs is not None and not score_rows and all(q == 1 and done > 0 for q, done in zip(query_lens, computed_lens)):
            logits = self.graphs.run(token_ids, computed_lens, block_tables, feed)
            if logits is not None:
                return logits[tensor_on(sample_rows, torch.long, self.device)]
        batch = self.attention.prepare(query_lens, computed_lens, block_tables)
        ends = torch.tensor(query_lens).cumsum(0) - 1
        sample_idx = ends[torch.tensor(sample_rows, dtype=torch.long)]
        if score_rows:
            sample_idx = torch.cat([sample_idx, torch.tensor(list(score_rows), dtype=torch.long)])
        input_ids = tensor_on(token_ids, torch.long, self.device)
        if feed is not None:
            feed.write_into(input_ids)
        return self.model(input_ids, batch, self._caches, to_device(sample_idx, self.device))

    @torch.inference_mode()
    def follow(self, on_task: Callable[[bytes], None] | None = None) -> None:
        """A rank other than 0: run each step rank 0 leads, until it says stop; `on_task` runs the
        worker's tasks (`lead_task`)."""
        while (plan := self.comm.follow()).kind != "stop":
            if plan.kind == "task" and on_task is not None:
                on_task(plan.payload)
            elif plan.kind == "copy":
                self._copy_block(*plan.copy)
            elif plan.kind == "forward":
                self._forward(plan.token_ids, plan.query_lens, plan.computed_lens, plan.block_tables,
                              plan.sample_rows, plan.score_rows)

    def lead_task(self, payload: bytes) -> None:
        """Rank 0: the other ranks run this task of the worker's (rank 0 runs its own part itself)."""
        self._lead(StepPlan("task", payload=payload))

    def stop_followers(self) -> None:
        self._lead(StepPlan("stop"))

    def keep_followers_waiting(self, every_s: float) -> None:
        """Rank 0, between steps: a follower waits for the next plan in a collective that times out, so an
        idle rank 0 sends an empty plan at least every `every_s` (well under that timeout)."""
        if self.comm.shard.size > 1 and time.monotonic() - self._led_at >= every_s:
            self._lead(StepPlan("idle"))

    def copy_block(self, src: int, dst: int) -> None:
        self._lead(StepPlan("copy", copy=(src, dst)))
        self._copy_block(src, dst)

    def _lead(self, plan: StepPlan) -> None:
        self.comm.lead(plan)
        self._led_at = time.monotonic()

    @torch.inference_mode()
    def _copy_block(self, src: int, dst: int) -> None:
        for k, v in self._caches:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
