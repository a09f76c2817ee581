"""tandem's CPU kernels (csrc/): attention over paged KV (paged_attention_cpu.c for decodes,
prefill_attention_cpu.c for prompts) and linear layers (float32:
linear_f32_cpu.c; bfloat16 on CPUs with AVX512-BF16: linear_bf16_cpu.c), built into one library with the machine's C compiler on first use, cached, and called
through ctypes on tensors' memory.

Why a plain C file and ctypes rather than a torch extension: it compiles in about a second with no torch
headers, and a call costs a few microseconds (30 layers a step). The build is keyed by the source, the
flags and this CPU's feature flags (-march=native), so a cache shared between machines never runs code
built for another CPU. ctypes releases the GIL for the call; the kernel's OpenMP threads are torch's
own runtime (the library it loads is already in the process), sized by torch.get_num_threads().
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("paged_attention_cpu.c", "prefill_attention_cpu.c", "linear_f32_cpu.c",
                                          "linear_bf16_cpu.c"))
HEADERS = (_CSRC / "attention_cpu.h",)
# -ffp-contract=fast: under -std=c11 GCC does not fuse `a += b * c` into one FMA instruction (ISO C mode
# turns contraction off), which doubled the kernel's arithmetic instructions and chained their latencies.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-std=c11")
DTYPES = (torch.float32, torch.bfloat16)
_ERRORS = {1: "head_dim over 256 or not a multiple of 16, block_size over 64, or query heads not a multiple of "
              "kv heads or over 64 per kv head", 3: "out of memory for the working rows"}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_build_error: str | None = None


class KernelUnavailable(RuntimeError):
    """The kernel could not be built here (no C compiler, or the build failed): the message says why."""


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_KERNEL_CACHE", Path.home() / ".cache" / "tandem" / "kernels"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler on PATH (install gcc, or set CC)")
    key = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES + HEADERS) + " ".join(FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / key / "tandem_cpu_kernels.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: workers that build at once each finish whole.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    done = subprocess.run([compiler, *FLAGS, "-o", partial, *map(str, SOURCES), "-lm"], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        os.unlink(partial)
        raise KernelUnavailable(f"{compiler} failed to build {', '.join(s.name for s in SOURCES)}: "
                                f"{done.stderr.strip()[-2000:]}")
    os.replace(partial, target)
    return target


def load() -> ctypes.CDLL:
    """The built kernel library; raises KernelUnavailable (the same reason every time) if it cannot be."""
    global _library, _build_error
    with _lock:
        if _library is None and _build_error is None:
            try:
                library = ctypes.CDLL(str(_build()))
            except (KernelUnavailable, OSError, subprocess.SubprocessError) as e:
                _build_error = str(e)
            else:
                for fn in (library.paged_attention, library.prefill_attention):
                    fn.restype = ctypes.c_int
                    fn.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6
                                   + [ctypes.c_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_int,
                                      ctypes.c_int, ctypes.c_void_p])
                for kind in ("f32", "bf16"):
                    pack, linear = getattr(library, f"linear_{kind}_pack"), getattr(library, f"linear_{kind}")
                    pack.restype = None
                    pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
                    linear.restype = ctypes.c_int
                    linear.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64]
                                       + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int])
                library.linear_bf16_supported.restype = ctypes.c_int
                library.linear_bf16_supported.argtypes = []
                _library = library
        if _library is None:
            raise KernelUnavailable(_build_error)
        return _library


def why_unavailable(dtype: torch.dtype) -> str | None:
    """Why the kernel cannot attend caches of `dtype` here, or None."""
    if dtype not in DTYPES:
        return f"it has no {dtype} version (float32 and bfloat16 only)"
    try:
        load()
    except KernelUnavailable as e:
        return str(e)
    return None


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                    chunk: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """Attend the query rows of each listed sequence to its cached context, into `out` (see the C file):
    the kernel for decodes and runs of a few tokens.
    `sinks`: float32 [H], contiguous (gpt-oss's per-head sink logits), or None.
    q, out [T, H, D]; caches [num_blocks, block_size, KVH, D], all contiguous and of one dtype;
    block_tables int32 [S, max_blocks]; query_starts, query_lens, context_lens int64 [S]."""
    _attend(load().paged_attention, "paged-attention", out, q, k_cache, v_cache, block_tables, query_starts,
            query_lens, context_lens, scale, window, softcap, chunk, sinks)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                      chunk: int | None = None, sinks: torch.Tensor | None = None) -> None:
    """paged_attention's contract, with the kernel for prompts and long chunks (csrc/prefill_attention_cpu.c:
    many queries per key, scored 16 rows at a time)."""
    _attend(load().prefill_attention, "prefill-attention", out, q, k_cache, v_cache, block_tables, query_starts,
            query_lens, context_lens, scale, window, softcap, chunk, sinks)


def _attend(fn, name: str, out, q, k_cache, v_cache, block_tables, query_starts, query_lens, context_lens, scale,
            window, softcap, chunk, sinks) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    code = fn(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
              query_starts.data_ptr(), query_lens.data_ptr(), context_lens.data_ptr(), len(query_lens),
              num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale, window or 0, chunk or 0,
              softcap or 0.0, q.dtype == torch.bfloat16, torch.get_num_threads(),
              None if sinks is None else sinks.data_ptr())
    if code:
        raise ValueError(f"the CPU {name} kernel refused this shape: {_ERRORS.get(code, code)}")


_LINEAR = {torch.float32: "f32", torch.bfloat16: "bf16"}


def linear_unavailable(dtype: torch.dtype) -> str | None:
    """Why the linear kernel cannot run `dtype` here (not float32 or bfloat16, no build, bfloat16 without
    AVX512-BF16), or None."""
    if dtype not in _LINEAR:
        return f"it has no {dtype} version (float32 and bfloat16 only)"
    try:
        library = load()
    except KernelUnavailable as e:
        return str(e)
    if dtype == torch.bfloat16 and not library.linear_bf16_supported():
        return "this CPU has no AVX512-BF16"
    if dtype == torch.bfloat16 and " amx_bf16" in _cpu_flags():
        # AMX multiplies whole tiles: oneDNN's AMX GEMM outruns a vdpbf16ps one at prefill sizes.
        return "this CPU has AMX, which oneDNN's bfloat16 GEMM uses"
    return None


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 [n, k] weight in the linear kernel's layout: panels of 16 output features, k-major
    within a panel (bfloat16: k in pairs), features and k past the weight's zero (see csrc/linear_*_cpu.c)."""
    weight = weight.detach().contiguous()
    n, k = weight.shape
    per_panel = 16 * k if weight.dtype == torch.float32 else 16 * 2 * (-(-k // 2))
    packed = torch.empty(-(-n // 16) * per_panel, dtype=weight.dtype)
    getattr(load(), f"linear_{_LINEAR[weight.dtype]}_pack")(weight.data_ptr(), n, k, packed.data_ptr(),
                                                            torch.get_num_threads())
    return packed


def linear(rows: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [m, k] (unit stride in k) times the packed weight, plus `bias` ([n], contiguous), all of the packed
    weight's dtype (float32, or bfloat16: products summed in float32, rounded once)."""
    m, k = rows.shape
    if rows.dtype != packed.dtype or rows.device.type != "cpu":  # the C code reads raw memory: refuse, never misread
        raise ValueError(f"the CPU linear kernel multiplies {packed.dtype} rows on the CPU, got {rows.dtype} on {rows.device}")
    out = torch.empty(m, out_features, dtype=packed.dtype)
    code = getattr(load(), f"linear_{_LINEAR[packed.dtype]}")(
        rows.data_ptr(), m, rows.stride(0), k, packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), out.data_ptr(), out_features, torch.get_num_threads())
    if code:
        raise RuntimeError(f"the CPU linear kernel has no {packed.dtype} path on this CPU")
    return out
