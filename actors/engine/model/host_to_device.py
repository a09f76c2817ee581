"""Step inputs from the host to the model's device without waiting for the device.

A copy from pageable host memory to a GPU waits for the stream's queued work first, so a step that
builds its index tensors while the previous step still runs (overlapped steps, engine.py) would wait
for it at every such copy. Through pinned memory the copy is queued like a kernel instead; torch's
pinned allocator keeps the host buffer until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`values` on `device`: a CPU tensor bound for a GPU through pinned memory; anything else as `to` does."""
    if device.type != "cuda" or values.device.type != "cpu":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def tensor_on(values, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A list (or nested lists) of numbers as a tensor on `device`, built on the host and sent without
    waiting; dtype None: torch's default for the values."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def copy_into(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """Fill a fixed device buffer (a CUDA graph's input) from a CPU tensor without waiting for the device."""
    buffer.copy_(values.pin_memory() if buffer.is_cuda and values.device.type == "cpu" else values, non_blocking=True)
