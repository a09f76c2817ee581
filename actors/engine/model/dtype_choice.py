"""The engine's dtype when the config says `auto`: the fastest one the machine computes in hardware.

As vLLM's platforms choose theirs (a float32 checkpoint is served in the platform's preferred half
precision where the platform has one):
- CPU: bfloat16 where the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX, read from its flags),
  else float32. Without either, oneDNN emulates bfloat16 matmuls and they ran ~3x slower than float32
  (an Ice Lake Xeon, README), so bfloat16 would be a loss there. vLLM's x86 CPU platform prefers bfloat16
  on every CPU; tandem asks for the hardware path because its float32 path (packed MKL GEMMs) is fast.
- CUDA: bfloat16 on compute capability 8.0 and later (Ampere on), float16 before it, float32 for Gemma 2/3
  there (their activations overflow float16; vLLM refuses float16 for them too).

Each process resolves `auto` once for its device and logs the choice with the reason (`resolve_dtype`);
every worker of a cluster resolves it on its own machine, so a cluster whose machines differ should pin
`model.dtype` (a prefill and a decode worker with different KV dtypes refuse each other's pages).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# x86 CPU flags (as /proc/cpuinfo names them) of a hardware bfloat16 matmul path.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_NO_FLOAT16 = frozenset({"gemma2", "gemma3", "gemma3_text"})  # model types float16 overflows


def choose_dtype(device_type: str, cpu_flags: frozenset[str] = frozenset(), cuda_capability: tuple[int, int] = (0, 0),
                 model_type: str | None = None) -> tuple[str, str]:
    """(dtype, why) for `auto` on a device of `device_type` ("cpu" or "cuda"): `cpu_flags` are the CPU's
    feature flags, `cuda_capability` the GPU's compute capability, `model_type` the checkpoint's."""
    if device_type == "cuda":
        if cuda_capability >= (8, 0):
            return "bfloat16", f"CUDA compute capability {cuda_capability[0]}.{cuda_capability[1]} has bfloat16"
        if model_type in _NO_FLOAT16:
            return "float32", f"no bfloat16 before compute capability 8.0, and {model_type} overflows float16"
        return "float16", "no bfloat16 before CUDA compute capability 8.0"
    if device_type != "cpu":
        return "float32", f"no preference known for {device_type}"
    found = sorted(BF16_CPU_FLAGS & cpu_flags)
    if found:
        return "bfloat16", f"this CPU has {' and '.join(found)}"
    return "float32", "this CPU has neither AVX512-BF16 nor AMX (bfloat16 matmuls would be emulated)"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags: the first `flags` line of /proc/cpuinfo, or (elsewhere) the bfloat16
    ones torch detects."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    import torch

    detected = {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_bf16": torch.cpu._is_amx_tile_supported()}
    return frozenset(name for name, present in detected.items() if present)


def resolve_dtype(dtype: str, device_type: str, model_type: str | None = None) -> str:
    """`dtype` itself, or for `auto` this machine's choice (logged once per process and device)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {', '.join(DTYPE_NAMES)}")
    if dtype != "auto":
        return dtype
    return _machine_choice(device_type, model_type)


@functools.lru_cache(maxsize=None)
def _machine_choice(device_type: str, model_type: str | None) -> str:
    capability = (0, 0)
    if device_type == "cuda":
        import torch

        capability = torch.cuda.get_device_capability()
    chosen, why = choose_dtype(device_type, cpu_flags() if device_type == "cpu" else frozenset(), capability,
                               model_type)
    log.info("model.dtype auto: %s (%s); pin model.dtype: float32 for exact float32 parity", chosen, why)
    return chosen
