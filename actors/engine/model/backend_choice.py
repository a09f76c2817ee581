"""Which attention backend a runner uses (attention_backend.py), from the engine config's
`attention_backend` ("auto", "sdpa", "cpu", "flashinfer" or "triton"), the device, the dtype and the layers.

auto: on a CPU, tandem's CPU kernel (cpu_paged_backend.py) when it builds here and fits the model, else
SDPA with a log line saying why; on CUDA, FlashInfer when it is installed and serves at least one layer,
else tandem's Triton kernel when triton is importable (it ships with CUDA builds of torch), else SDPA,
with a log line saying why. An explicit choice that cannot run is an error naming the reason, never a
silent fallback. Layers FlashInfer refuses attend with SDPA inside the same step, logged once here.
"triton" on a CPU runs in Triton's interpreter only when TRITON_INTERPRET=1 (tests and dry runs).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from actors.engine.model.attention import SdpaBackend
from actors.engine.model.attention_backend import AttentionBackend, LayerAttention
from actors.engine.model.cpu_paged_backend import CpuPagedBackend, why_not_cpu
from actors.engine.model.flashinfer_backend import FlashInferBackend, refusal
from actors.engine.model.triton_backend import TritonBackend

log = logging.getLogger(__name__)
CHOICES = ("auto", "sdpa", "cpu", "flashinfer", "triton")


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def choose_attention_backend(choice: str, layers: tuple[LayerAttention, ...], windows: tuple[int | None, ...],
                             block_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if choice not in CHOICES:
        raise ValueError(f"engine attention_backend={choice!r}: must be one of {', '.join(CHOICES)}")
    if choice == "sdpa":
        return SdpaBackend(block_size, windows, device)
    if choice == "cpu" or (choice == "auto" and device.type == "cpu"):
        why_not = why_not_cpu(layers, dtype, device)
        if why_not is None:
            return CpuPagedBackend(block_size)
        if choice == "cpu":
            raise ValueError(f"engine attention_backend='cpu' cannot run here: {why_not}")
        log.warning("attention runs on SDPA: not the CPU kernel: %s", why_not)
        return SdpaBackend(block_size, windows, device)
    if choice == "auto" and device.type != "cuda":
        return SdpaBackend(block_size, windows, device)
    reasons = {}
    for name in ("flashinfer", "triton") if choice == "auto" else (choice,):
        why_not = (_why_not_flashinfer(layers, dtype, device) if name == "flashinfer"
                   else _why_not_triton(layers, device))
        if why_not is None:
            return _build(name, layers, windows, block_size, dtype, device)
        if choice != "auto":
            raise ValueError(f"engine attention_backend={choice!r} cannot run here: {why_not}")
        reasons[name] = why_not
    log.warning("attention runs on SDPA: %s", "; ".join(f"not {name}: {why}" for name, why in reasons.items()))
    return SdpaBackend(block_size, windows, device)


def _build(name: str, layers, windows, block_size: int, dtype: torch.dtype, device: torch.device) -> AttentionBackend:
    if name == "triton":
        return TritonBackend(block_size, windows, device)
    for layer in layers:
        if (why := refusal(layer, dtype)) is not None:
            log.warning("layers with %s attend with SDPA: FlashInfer cannot serve %s", layer, why)
    return FlashInferBackend(layers, windows, block_size, dtype, device)


def _why_not_flashinfer(layers: tuple[LayerAttention, ...], dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"FlashInfer's kernels need a CUDA device, this engine runs on {device.type}"
    if not installed("flashinfer"):
        return "the flashinfer-python package is not installed (pip install flashinfer-python flashinfer-cubin)"
    refused = [refusal(layer, dtype) for layer in layers]
    if all(refused):
        return f"it serves none of this model's layers: {refused[0]}"
    return None


def _why_not_triton(layers: tuple[LayerAttention, ...], device: torch.device) -> str | None:
    if any(layer.sinks is not None for layer in layers):
        return "its kernel has no attention sinks (gpt-oss)"
    if not installed("triton"):
        return "triton is not installed (CUDA builds of torch ship it)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"its kernel needs a CUDA device, this engine runs on {device.type} (TRITON_INTERPRET=1 runs it in Triton's interpreter)"
    return None
