"""Tensor parallelism inside one worker: which slice of each weight a rank holds, and the collectives
its forward pass needs.

Megatron's split: q/k/v and gate/up are split by output rows (each rank runs whole heads and a slice
of the MLP's width), o and down by input columns (each rank's partial sums are all-reduced), the
embedding and the LM head by vocabulary rows (the embedding's rows are all-reduced, the logits
gathered). KV heads are split too; with more ranks than KV heads, each rank keeps the one KV head its
query heads read (replicated, as vLLM does). Experts are split like a dense MLP, each by its width.

`TPComm` is the group a rank's collectives run in: `SINGLE` (no-op) in a one-process worker, or the
torch.distributed default group of a worker's rank processes (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPShard:
    rank: int = 0
    size: int = 1

    def split(self, n: int) -> tuple[int, int]:
        """This rank's equal part of n."""
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        if self.size <= num_kv_heads:
            return self.split(num_kv_heads)
        first_q = self.split(num_heads)[0]
        head = first_q // (num_heads // num_kv_heads)  # the KV head this rank's query heads read
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """Rows of the embedding and LM head: equal parts of the vocabulary rounded up, the last one short."""
        part = -(-vocab_size // self.size)
        return min(self.rank * part, vocab_size), min((self.rank + 1) * part, vocab_size)

    def check(self, cfg) -> None:
        """Refuse a layout whose heads or widths do not split evenly over the ranks, naming the field."""
        n = self.size
        problems = []
        if cfg.num_heads % n:
            problems.append(f"num_attention_heads={cfg.num_heads}")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"num_key_value_heads={cfg.num_kv_heads} (nor does {n} split into it)")
        if cfg.intermediate_size % n:
            problems.append(f"intermediate_size={cfg.intermediate_size}")
        if cfg.num_experts and cfg.expert_intermediate_size % n:
            problems.append(f"expert intermediate size={cfg.expert_intermediate_size}")
        problems += [f"{name}={getattr(cfg, name)}" for name in getattr(cfg, "tp_split_fields", ())
                     if getattr(cfg, name) % n]
        if problems:
            raise ValueError(f"tensor_parallel_size={n} does not divide {', '.join(problems)}")

    def local_config(self, cfg):
        """The per-rank config: its share of the heads and MLP widths (the vocabulary stays whole: the
        engine validates token ids against it)."""
        if self.size == 1:
            return cfg
        self.check(cfg)
        kv0, kv1 = self.kv_heads(cfg.num_kv_heads, cfg.num_heads)
        return dataclasses.replace(
            cfg, num_heads=cfg.num_heads // self.size, num_kv_heads=kv1 - kv0,
            intermediate_size=cfg.intermediate_size // self.size,
            expert_intermediate_size=cfg.expert_intermediate_size // self.size,
            **{name: getattr(cfg, name) // self.size for name in getattr(cfg, "tp_split_fields", ())},
        )


@dataclass
class StepPlan:
    """What rank 0 tells the other ranks each step: a forward pass (the runner's arguments), a block copy
    (a fork's partial block), a task of the worker's (opaque bytes, e.g. a KV handoff every rank sends
    its part of), or stop."""

    kind: str  # "forward" | "copy" | "task" | "stop" | "idle" (nothing to run: the followers' wait starts over)
    token_ids: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    computed_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    copy: tuple[int, int] = (0, 0)
    score_rows: list[int] = field(default_factory=list)
    payload: bytes = b""


_KINDS = ("stop", "forward", "copy", "idle", "task")


class TPComm:
    """The collectives of one rank's forward pass; this base is the single-rank no-op."""

    shard = TPShard()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return logits

    def lead(self, plan: StepPlan) -> None:
        """Rank 0: send the step to the other ranks (before running it itself)."""

    def follow(self) -> StepPlan:
        raise RuntimeError("a single-rank worker has no leader to follow")

    def agree(self, value) -> list:
        """Every rank's `value` (a small picklable object), in rank order, on every rank."""
        return [value]


SINGLE = TPComm()


class DistComm(TPComm):
    """A rank of a worker's torch.distributed group (the default group of its process)."""

    def __init__(self, shard: TPShard):
        self.shard = shard
        # Step plans are small host-side integers: with NCCL carrying the activations they go over gloo.
        self._plans = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def lead(self, plan: StepPlan) -> None:
        tables = plan.block_tables
        width = max((len(t) for t in tables), default=0)
        header = torch.tensor([_KINDS.index(plan.kind), len(plan.token_ids) or len(plan.payload),
                               len(plan.query_lens), len(plan.sample_rows), width, *plan.copy, len(plan.score_rows)],
                              dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._plans)
        if plan.kind == "task":
            dist.broadcast(torch.frombuffer(bytearray(plan.payload), dtype=torch.uint8), src=0, group=self._plans)
        if plan.kind != "forward":
            return
        padded = [t + [0] * (width - len(t)) for t in tables]
        body = torch.tensor(plan.token_ids + plan.query_lens + plan.computed_lens + plan.sample_rows
                            + [b for t in padded for b in t] + [len(t) for t in tables] + plan.score_rows,
                            dtype=torch.int64)
        dist.broadcast(body, src=0, group=self._plans)

    def follow(self) -> StepPlan:
        header = torch.empty(8, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._plans)
        kind, n_tokens, n_seqs, n_samples, width, src, dst, n_scores = header.tolist()
        if _KINDS[kind] == "task":
            payload = torch.empty(n_tokens, dtype=torch.uint8)
            dist.broadcast(payload, src=0, group=self._plans)
            return StepPlan("task", payload=payload.numpy().tobytes())
        if _KINDS[kind] != "forward":
            return StepPlan(_KINDS[kind], copy=(src, dst))
        body = torch.empty(n_tokens + 3 * n_seqs + n_samples + n_seqs * width + n_scores, dtype=torch.int64)
        dist.broadcast(body, src=0, group=self._plans)
        values = body.tolist()
        cut = [n_tokens, n_seqs, n_seqs, n_samples, n_seqs * width]
        tokens, query_lens, computed_lens, sample_rows, flat = (
            values[sum(cut[:i]) : sum(cut[: i + 1])] for i in range(len(cut)))
        lens = values[sum(cut) : sum(cut) + n_seqs]
        scores = values[sum(cut) + n_seqs :]
        tables = [flat[i * width : i * width + lens[i]] for i in range(n_seqs)]
        return StepPlan("forward", tokens, query_lens, computed_lens, tables, sample_rows, score_rows=scores)

    def agree(self, value) -> list:
        values = [None] * self.shard.size
        dist.all_gather_object(values, value, group=self._plans)
        return values

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's vocabulary slice of the logits [T, part], concatenated on every rank [T, vocab]."""
        part = -(-vocab_size // self.shard.size)
        if logits.shape[-1] < part:  # the last rank's slice is short: pad to the common size
            logits = torch.nn.functional.pad(logits, (0, part - logits.shape[-1]))
        pieces = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.all_gather(pieces, logits.contiguous())
        return torch.cat(pieces, dim=-1)[..., :vocab_size]


def rank_slice(name: str, cfg, shard: TPShard) -> tuple[int, list[tuple[int, int]]] | None:
    """Which part of tandem's parameter `name` (of the whole model, `cfg`) this rank holds: (dim, index
    ranges along it), or None when every rank holds all of it (norms, the router, q/k norms)."""
    if shard.size == 1:
        return None
    d = cfg.head_dim
    if name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        q0, q1 = shard.split(cfg.num_heads)
        k0, k1 = shard.kv_heads(cfg.num_kv_heads, cfg.num_heads)
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d
        return 0, [(q0 * d, q1 * d), (q_rows + k0 * d, q_rows + k1 * d),
                   (q_rows + kv_rows + k0 * d, q_rows + kv_rows + k1 * d)]
    if name.endswith("attn.o.weight"):
        q0, q1 = shard.split(cfg.num_heads)
        return 1, [(q0 * d, q1 * d)]
    if name.endswith(("mlp.gate_up.weight", "mlp.gate_up")):  # dense [2I, H] or experts [E, 2I, H]
        width = cfg.expert_intermediate_size if name.endswith("mlp.gate_up") else cfg.intermediate_size
        i0, i1 = shard.split(width)
        return (1 if name.endswith("mlp.gate_up") else 0), [(i0, i1), (width + i0, width + i1)]
    if name.endswith("attn.sinks"):  # gpt-oss: one per query head
        return 0, [shard.split(cfg.num_heads)]
    if name.endswith("mlp.gate_up_bias"):  # gpt-oss's experts [E, 2I], split like their gate_up
        i0, i1 = shard.split(cfg.expert_intermediate_size)
        return 1, [(i0, i1), (cfg.expert_intermediate_size + i0, cfg.expert_intermediate_size + i1)]
    if name.endswith("mlp.down.weight"):
        return 1, [shard.split(cfg.intermediate_size)]
    if name.endswith("mlp.down"):  # experts [E, H, I]
        return 2, [shard.split(cfg.expert_intermediate_size)]
    if name.endswith("mlp.shared.gate_up.weight"):  # Llama 4's shared expert, as wide as an expert
        width = cfg.expert_intermediate_size
        i0, i1 = shard.split(width)
        return 0, [(i0, i1), (width + i0, width + i1)]
    if name.endswith("mlp.shared.down.weight"):
        return 1, [shard.split(cfg.expert_intermediate_size)]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, [shard.vocab(cfg.vocab_size)]
    return None
