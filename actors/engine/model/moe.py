"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks the top-k experts of each token,
and the token's output is the router-weighted sum of those experts' gated MLPs.

The experts' weights are stacked, `gate_up` [E, 2 * I, H] and `down` [E, H, I]; each expert runs once
per step on just the tokens routed to it (tokens sorted by expert), so a step costs about top-k dense
MLPs whatever the number of experts.

Subclasses change the routing (`route`), the expert MLP (`expert`: gpt_oss.py) and where the router weight
applies (`scales_inputs`: Llama 4 scales each token's input to an expert, not the expert's output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.model.parallel import SINGLE, TPComm

if TYPE_CHECKING:
    from actors.engine.model.llama import LlamaConfig


class SparseMoE(nn.Module):
    tp: TPComm = SINGLE  # a tensor-parallel rank's group (LlamaModel.attach); each expert is split by its width
    scales_inputs = False  # the router weight multiplies the expert's input rather than its output

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        experts, size, hidden = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        self.top_k = cfg.experts_per_token
        self.normalize = cfg.normalize_expert_weights
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts' float32 weights [T, k] and the experts [T, k]."""
        # Routing in float32 whatever the weights' dtype, as the reference implementations do.
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index`'s gated MLP on the rows routed to it."""
        gate, up = F.linear(x, self.gate_up[index]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)  # [T, k]
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        token_of = order // self.top_k  # the token behind each (token, choice) pair, grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            weight = weights.flatten()[pairs, None]
            rows = (x[tokens] * weight).to(x.dtype) if self.scales_inputs else x[tokens]
            y = self.expert(expert, rows)
            out.index_add_(0, tokens, (y if self.scales_inputs else y * weight).to(x.dtype))
        return self.tp.all_reduce(out)
