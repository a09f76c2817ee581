"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks the top-k experts of each token,
and the token's output is the router-weighted sum of those experts' gated MLPs.

The experts' weights are stacked, `gate_up` [E, 2 * I, H] and `down` [E, H, I]; each expert runs once
per step on just the tokens routed to it (tokens sorted by expert), so a step costs about top-k dense
MLPs whatever the number of experts.
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

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        experts, size, hidden = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size
        self.top_k = cfg.experts_per_token
        self.normalize = cfg.normalize_expert_weights
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, size))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight [T, k] (float32) and the index [T, k] of each token's chosen experts."""
        # Routing in float32 whatever the weights' dtype, as the reference implementations do.
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.route(x)
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
            gate, up = F.linear(x[tokens], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert])
            out.index_add_(0, tokens, (y * weights.flatten()[pairs, None]).to(x.dtype))
        return self.tp.all_reduce(out)
