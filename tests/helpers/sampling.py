"""Sampling test helpers."""

from __future__ import annotations

import torch


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs).flatten().tolist())
