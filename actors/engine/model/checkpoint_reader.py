"""Checkpoint tensors read lazily, and only the slice a tensor-parallel rank holds.

A `Source` stands for one of tandem's parameters before any byte is read: one checkpoint tensor
(`Part`), several concatenated along their first dim (`Cat`, e.g. q, k and v into the fused qkv), or
experts stacked (`Stack`). `read(dim, ranges)` reads the given index ranges along `dim` of that
parameter (None: all of it) through safetensors' slices, so a rank of a tensor-parallel worker reads
its share of each weight from disk, never the whole checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

Ranges = list[tuple[int, int]] | None


class Part:
    def __init__(self, handle, name: str):
        self.name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, dim: int, ranges: Ranges) -> torch.Tensor:
        if ranges is None:
            return self._slice[:]
        index = [slice(None)] * len(self.shape)
        pieces = []
        for start, stop in ranges:
            index[dim] = slice(start, stop)
            pieces.append(self._slice[tuple(index)])
        return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


class Cat:
    """Parts concatenated along dim 0 (each part's other dims equal)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])

    def read(self, dim: int, ranges: Ranges) -> torch.Tensor:
        if ranges is None or dim != 0:
            return torch.cat([p.read(dim, ranges) for p in self.parts], dim=0)
        pieces = []
        for start, stop in ranges:
            offset = 0
            for part in self.parts:
                low, high = max(start, offset), min(stop, offset + part.shape[0])
                if low < high:
                    pieces.append(part.read(0, [(low - offset, high - offset)]))
                offset += part.shape[0]
        return torch.cat(pieces, dim=0)


class Stack:
    """Experts' weights stacked along a new first dim."""

    def __init__(self, items: list):
        self.items = items
        self.shape = (len(items), *items[0].shape)

    def read(self, dim: int, ranges: Ranges) -> torch.Tensor:
        if ranges is not None and dim == 0:
            raise ValueError("experts are not split by expert")
        return torch.stack([item.read(dim - 1, ranges) if ranges is not None else item.read(0, None)
                            for item in self.items])


class Interleaved:
    """gpt-oss's experts: gate and up alternate along the last dim of the checkpoint's `gate_up_proj` [E, H, 2I]
    and its bias [E, 2I]; read as SparseMoE's layout, gate rows then up rows along dim 1 ([E, 2I, H], [E, 2I])."""

    def __init__(self, part):
        self.part = part
        self.width = part.shape[-1] // 2
        self.shape = (part.shape[0], part.shape[-1], *part.shape[1:-1])

    def read(self, dim: int, ranges: Ranges) -> torch.Tensor:
        if ranges is not None and dim != 1:
            raise ValueError("gpt-oss experts are split only by their width")
        last = len(self.part.shape) - 1
        pieces = []
        for start, stop in ranges or [(0, 2 * self.width)]:
            for half, offset in ((0, 0), (1, self.width)):  # gate at even columns, up at odd ones
                low, high = max(start, offset) - offset, min(stop, offset + self.width) - offset
                if low < high:
                    pieces.append(self.part.read(last, [(2 * low, 2 * high)])[..., half::2])
        return torch.cat(pieces, dim=-1).transpose(1, -1).contiguous()


class Transposed:
    """Stacked experts' weights [E, A, B] read as [E, B, A]: Llama 4 and gpt-oss save them for x @ W, tandem
    runs F.linear (x @ W.T)."""

    def __init__(self, part):
        self.part = part
        self.shape = (part.shape[0], part.shape[2], part.shape[1])

    def read(self, dim: int, ranges: Ranges) -> torch.Tensor:
        if ranges is not None and dim == 0:
            raise ValueError("experts are not split by expert")
        whole = self.part.read(0, None) if ranges is None else self.part.read(3 - dim, ranges)
        return whole.transpose(1, 2).contiguous()


class CheckpointFiles:
    """The open *.safetensors of a checkpoint directory (a context manager: the files close on exit)."""

    def __init__(self, model_dir: Path):
        self.files = sorted(Path(model_dir).glob("*.safetensors"))
        if not self.files:
            raise ValueError(f"model directory {model_dir} has no *.safetensors weights")
        self._handles = []

    def __enter__(self) -> dict[str, Part]:
        parts = {}
        for file in self.files:
            handle = safe_open(str(file), framework="pt")
            handle.__enter__()
            self._handles.append(handle)
            parts.update({name: Part(handle, name) for name in handle.keys()})  # noqa: SIM118 (not a dict)
        return parts

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.__exit__(None, None, None)
        self._handles.clear()
