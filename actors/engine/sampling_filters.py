"""Truncation filters of the sampling pipeline: top-k, top-p, min-p and typical-p.

Each takes probabilities [rows, V] (or [V]) and a value per row (or one for all), and returns the
renormalized probabilities of the tokens it keeps, same shape; a bad value raises `ValueError` naming
the parameter. `actors.engine.sampling` applies them in that order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# --- Truncation filters: probs [rows, V] (or [V]) in, renormalized probs of the same shape out. ---


def top_k_filter(probs: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep the `k` most likely tokens of each row; ties go to the lower token id.

    At most k tokens keep a nonzero probability; k >= V keeps every token. `k` is an int >= 1 or a
    1-D integer tensor with one value per row.
    """
    return _apply_filter(top_k_rows, probs, k, "k", "an integer >= 1", lambda t: t >= 1, integer=True)


def top_p_filter(probs: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches `p`.

    Tokens are ranked by probability (ties: lower id first); token i is kept when the mass ranked
    before it is < p, so the token that crosses `p` is kept and at least one token always is.
    `p` is in (0, 1]; p == 1 keeps every token.
    """
    return _apply_filter(top_p_rows, probs, p, "p", "in (0, 1]", lambda t: (t > 0) & (t <= 1))


def min_p_filter(probs: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is >= alpha * (the row's largest probability); alpha in [0, 1]."""
    return _apply_filter(min_p_rows, probs, alpha, "alpha", "in [0, 1]", lambda t: (t >= 0) & (t <= 1))


def typical_filter(probs: torch.Tensor, mass: float | torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): keep tokens whose surprisal is nearest the entropy.

    Tokens are ranked by |-log p - H| ascending (ties: lower id first) and the smallest prefix whose
    mass reaches `mass` is kept, boundary token included. This can drop the most likely token.
    `mass` is in (0, 1]; mass == 1 keeps every token.
    """
    return _apply_filter(typical_rows, probs, mass, "mass", "in (0, 1]", lambda t: (t > 0) & (t <= 1))


def _apply_filter(kernel, probs, value, name: str, rule: str, valid: Callable, integer: bool = False):
    """Validate a public filter call, run the batched kernel on a 2-D view, restore the input's shape."""
    if not isinstance(probs, torch.Tensor) or probs.ndim not in (1, 2) or not probs.is_floating_point():
        raise ValueError("probs must be a floating-point tensor of shape [V] or [rows, V]")
    batch = probs if probs.ndim == 2 else probs.unsqueeze(0)
    column = torch.as_tensor(value, device=probs.device)
    if column.ndim > 1 or column.numel() not in (1, batch.shape[0]):
        raise ValueError(
            f"{name} must be a number or a 1-D tensor with one value per row ({batch.shape[0]}), "
            f"got shape {tuple(column.shape)}"
        )
    if integer and (column.is_floating_point() or column.dtype == torch.bool):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    if not bool(valid(column).all()):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    if column.is_floating_point():
        column = column.to(probs.dtype)
    out = kernel(batch, column.reshape(-1, 1))
    return out if probs.ndim == 2 else out.squeeze(0)


def top_k_rows(probs: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = k.clamp(max=probs.shape[-1]).expand(probs.shape[0], 1)
    threshold = probs.topk(int(k.max()), dim=-1).values.gather(-1, k - 1)
    return _keep_top(probs, k, threshold)


def top_p_rows(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    # The nucleus is the top-`size` tokens; find `size` from the largest probabilities only, sorting a
    # whole row just where the nucleus reaches past the window.
    vocab = probs.shape[-1]
    p = p.expand(probs.shape[0], 1)
    size, threshold = _nucleus(probs.topk(min(vocab, _TOP_P_WINDOW), dim=-1).values, p)
    if vocab > _TOP_P_WINDOW:
        past = ((size == _TOP_P_WINDOW) & (p < 1)).squeeze(1)
        if bool(past.any()):
            size[past], threshold[past] = _nucleus(probs[past].sort(dim=-1, descending=True).values, p[past])
    every = p >= 1
    size = size.masked_fill(every, vocab)
    return _keep_top(probs, size, threshold.masked_fill(every, float("-inf")))


_TOP_P_WINDOW = 1024


def _nucleus(ranked: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Size and smallest probability of the nucleus, from probabilities sorted descending.

    Token i is in when the mass ranked before it is < p: that keeps the token crossing p, and the first.
    """
    cumulative = ranked.cumsum(dim=-1)
    size = 1 + (cumulative[:, :-1] < p).sum(dim=-1, keepdim=True)
    return size, ranked.gather(-1, size - 1)


def _keep_top(probs: torch.Tensor, k: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Keep the k[row] most likely tokens, whose smallest probability is threshold[row]; ties to lower ids."""
    keep = probs >= threshold
    # More tokens tie at the threshold than fit: the lowest ids among them stay. Zeros may all stay.
    excess = ((keep.sum(dim=-1, keepdim=True) > k) & (threshold > 0)).squeeze(1)
    if bool(excess.any()):
        sub, at = probs[excess], threshold[excess]
        above, tied = sub > at, sub == at
        need = k[excess] - above.sum(dim=-1, keepdim=True)
        keep[excess] = above | (tied & (tied.cumsum(dim=-1) <= need))
    return _renormalize(probs, keep)


def min_p_rows(probs: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return _renormalize(probs, probs >= alpha * probs.amax(dim=-1, keepdim=True))


def typical_rows(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    entropy = -torch.special.xlogy(probs, probs).sum(dim=-1, keepdim=True)
    gap = (-probs.log() - entropy).abs()  # +inf for zero-probability tokens: ranked last
    order = gap.argsort(dim=-1, stable=True)
    ranked = probs.gather(-1, order)
    cumulative = ranked.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    keep_ranked = (before < mass) | (mass >= 1)
    return _renormalize(probs, torch.zeros_like(keep_ranked).scatter_(-1, order, keep_ranked))


def _renormalize(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept.div_(kept.sum(dim=-1, keepdim=True))
