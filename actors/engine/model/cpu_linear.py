"""CPU fast path: linear layers whose weights are pre-packed once for the CPU's GEMM library.

A plain `F.linear` on CPU re-packs the weight matrix on every call; at decode batch sizes that packing
is a large part of the step. Packing once at load makes small-batch matmuls about 2x faster, and each
row's result no longer depends on how many rows share the call (batch-invariant outputs).

- float32: tandem's own GEMM (csrc/linear_f32_cpu.c through cpu_kernel.py), where the machine's C compiler
  builds it: each output element one chain of fused multiply-adds in k order, so a row's result is the same
  bits however many rows share the call. On a 2-core AMD EPYC (Zen 4), one thread, SmolLM2's shapes:
  1.5-2.0x MKL's packed GEMM at 1-4 rows, 1.35-1.55x at 16, 1.2-1.25x at 64, 1.1-1.2x at 512. Without a
  compiler, MKL's packed GEMM (`torch.ops.mkl`). Either keeps the original weight beside its packed copy.
- bfloat16: oneDNN's (`torch.ops.mkldnn`), bfloat16 products summed in float32, on a CPU whose oneDNN
  has a bfloat16 path (AVX512-BF16 or AMX). The op reads only the packed copy; the original is dropped
  unless another module shares it (tied embeddings). Measured on a 2-core AVX512-BF16 Xeon at SmolLM2's
  shapes (one thread): 1.2-3.7x faster than the packed float32 GEMM at 1-64 rows, 2.3-3.3x at 512-2048,
  and faster than bfloat16 `F.linear` by up to 2x at 1-16 rows (equal at prefill sizes).
- anything else (float16, CUDA): the module is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from actors.engine.model import cpu_kernel

_PACK_BATCH_HINT = 64  # the batch size the libraries tune the packed layout for; any batch size works


def linear_packing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Which packed GEMM serves this device and dtype: "kernel" (tandem's), "mkl", "onednn", or None (plain
    F.linear)."""
    if device.type != "cpu":
        return None
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernel.linear_unavailable(dtype) is None:
        return "kernel"
    if dtype == torch.float32 and torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"):
        return "mkl"
    if (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "onednn"
    return None


class _Packed(nn.Module):
    """A linear layer over a weight packed once; each subclass's `_matmul` is its library's product of a
    [rows, in] matrix with the packed weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return self._matmul(rows).view(*x.shape[:-1], -1)


class PackedLinear(_Packed):
    """float32, MKL: the op takes the packed weight and the original."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(rows, self.packed_weight, self.weight, self.bias, rows.shape[0])


class KernelLinear(_Packed):
    """float32 or bfloat16, tandem's kernel: the op reads only the packed copy. A float32 module keeps its
    original too, as MKL's did (model code may read it); a bfloat16 one drops it, as oneDNN's did, unless
    another module shares it (tied embeddings)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        if linear.weight.dtype == torch.float32:
            self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed_weight", cpu_kernel.pack_linear(linear.weight), persistent=False)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        bias = None if self.bias is None else self.bias.detach().contiguous()
        return cpu_kernel.linear(rows, self.packed_weight, self.out_features, bias)


class OneDnnLinear(_Packed):
    """bfloat16, oneDNN: the op takes only the packed weight (an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.out_features = linear.out_features
        self.bias = linear.bias
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed_weight, self.bias, "none", [None], "")


_PACKED = {"kernel": KernelLinear, "mkl": PackedLinear, "onednn": OneDnnLinear}


def pack_linears(model: nn.Module, packing: str = "mkl") -> int:
    """Replace every nn.Linear in the model by its packed module for `packing` (linear_packing's answer);
    returns how many were replaced."""
    cls = _PACKED[packing]
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, cls(child))
    return len(targets)
