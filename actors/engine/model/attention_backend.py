"""The contract between the runner, the model's attention layers and the kernels that attend.

Who calls what, once per engine step:
- the runner calls `backend.prepare(query_lens, computed_lens, block_tables)` and passes the
  `StepAttention` it returns to the model's forward;
- the model reads `step.positions` (rotary embedding) and every attention layer calls
  `step.attend(q, k, v, k_cache, v_cache, layer)` exactly once.

`attend` promises: the layer's new K/V rows are in the cache at `step.slot_mapping` before any query
reads them (a query attends to its own token), and the output is `[T, num_heads, head_dim]` in the flat
token order of the step. A backend may not serve every layer (`refuses`): a step then attends those
layers with the reference implementation (attention.py, SDPA) and says so once, at selection.

Backends: `sdpa` (attention.py: torch's scaled_dot_product_attention over gathered blocks; every device,
and the reference), `cpu` (cpu_paged_backend.py: tandem's C kernels reading the blocks in place, for
decodes and for prompts), `flashinfer` (flashinfer_backend.py: FlashInfer's paged kernels on CUDA
reading the block tables directly) and `triton` (triton_backend.py: tandem's own paged decode kernel,
SDPA for prefill). `backend_choice.py` picks one.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerAttention:
    """What a kernel must know about one attention layer; layers equal in it share a step's plan."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int | None  # keys within this many positions of the query (itself included); None: all
    softcap: float | None  # scores become tanh(s / softcap) * softcap (Gemma 2)
    # Keys in the query's own chunk of this many positions (Llama 4's local layers: positions
    # c*chunk .. c*chunk + chunk - 1 attend only among themselves); None: no chunks.
    chunk: int | None = None
    # gpt-oss: one learned logit per query head that joins the softmax's denominator and attends nothing
    # (a value, not a tensor, so that layers compare and hash by it); None: no sinks.
    sinks: tuple[float, ...] | None = None


@functools.lru_cache(maxsize=256)
def sink_logits(sinks: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A layer's sink logits as a float32 tensor on `device`, built once per layer and device."""
    return torch.tensor(sinks, dtype=torch.float32, device=device)


class StepAttention(ABC):
    """One step's attention state, shared by every layer of the forward pass."""

    positions: torch.Tensor  # [T] position of every flat token
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) each new K/V goes to

    @abstractmethod
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, layer: LayerAttention) -> torch.Tensor:
        """q [T, H, D], k and v [T, KVH, D]; caches [num_blocks, block_size, KVH, D]. See the module."""


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def prepare(self, query_lens: list[int], computed_lens: list[int],
                block_tables: list[list[int]]) -> StepAttention:
        """The step's attention state: sequence i runs query_lens[i] new tokens after computed_lens[i]
        cached ones, its context in the blocks block_tables[i]."""

    def refuses(self, layer: LayerAttention) -> str | None:
        """Why this backend cannot attend `layer` (it then falls back to SDPA), or None."""
        return None



class GraphableBackend(AttentionBackend):
    """A backend whose decode steps can be captured in CUDA graphs (decode_graphs.py)."""

    @abstractmethod
    def graph_step(self, batch_size: int, max_pages_per_seq: int) -> StepAttention:
        """A decode step of `batch_size` sequences whose tensors keep their size and address for a CUDA
        graph; its `plan(query_lens, computed_lens, block_tables)` refills them before each replay."""


_SHORT_RUN = 64  # query tokens up to which a sequence's positions and slots are counted out in Python


def positions_and_slots(query_lens: list[int], computed_lens: list[int], block_tables: list[list[int]],
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On the CPU: the position and the cache slot of every new token of the step, in flat order (int64).
    Short query runs (decodes, small chunks) are counted out in Python, long prefills as tensor ops: a
    tensor op per decode sequence cost ~25 us, 0.8 ms a step at batch 32 here."""
    positions, slots = [], []
    short_positions: list[int] = []
    short_slots: list[int] = []

    def flush() -> None:
        if short_positions:
            positions.append(torch.tensor(short_positions, dtype=torch.long))
            slots.append(torch.tensor(short_slots, dtype=torch.long))
            short_positions.clear()
            short_slots.clear()

    for q_len, done, table in zip(query_lens, computed_lens, block_tables):
        end = done + q_len
        if q_len <= _SHORT_RUN:
            short_positions.extend(range(done, end))
            short_slots.extend(table[p // block_size] * block_size + p % block_size for p in range(done, end))
            continue
        flush()
        first, last = done // block_size, -(-end // block_size)
        blocks = torch.tensor(table[first:last], dtype=torch.long)
        positions.append(torch.arange(done, end))
        slots.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[done - first * block_size:
                                                                                          end - first * block_size])
    flush()
    if len(positions) == 1:
        return positions[0], slots[0]
    if not positions:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return torch.cat(positions), torch.cat(slots)


def write_new_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Put the step's new K/V rows into their cache slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
