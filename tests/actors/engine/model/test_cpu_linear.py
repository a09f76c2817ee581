"""tandem's CPU GEMMs (csrc/linear_f32_cpu.c, and linear_bf16_cpu.c where the CPU has AVX512-BF16 and no
AMX, through cpu_linear.KernelLinear): the linear layer's product within the dtype's rounding of a float64
reference, and a row's result the same bits whatever rows share the call, however many threads split it
(what keeps greedy outputs identical across layouts); a model's linear layers are packed for it, and
without a C compiler float32 falls back to MKL's packed GEMM."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from actors.engine.model import cpu_kernel
from actors.engine.model.cpu_linear import KernelLinear, linear_packing, pack_linears

pytestmark = pytest.mark.skipif(cpu_kernel.why_unavailable(torch.float32) is not None,
                                reason="tandem's CPU kernels need a C compiler")
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    cpu_kernel.linear_unavailable(torch.bfloat16) is not None,
    reason=f"the bfloat16 GEMM: {cpu_kernel.linear_unavailable(torch.bfloat16)}"))
DTYPES = [torch.float32, BF16]
# Relative rounding of one result: float32's sum; bfloat16's sum is float32, rounded to bfloat16 once.
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8}

# SmolLM2's shapes, one whose features are not a multiple of 16 (nor of a tile's 64), one of a single panel.
SHAPES = [(576, 576), (1536, 576), (576, 1536), (100, 37), (7, 16)]


def _layer(out_features: int, in_features: int, bias: bool, seed: int, dtype=torch.float32) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_the_product_is_the_linear_layer_s(shape, bias, dtype):
    layer = _layer(*shape, bias, seed=1, dtype=dtype)
    want_weight = layer.weight.double()
    packed = KernelLinear(layer)
    x = torch.randn(3, 11, shape[1]).to(dtype)  # any leading shape, as the model's modules send
    with torch.no_grad():
        got = packed(x)
        want = nn.functional.linear(x.double(), want_weight, None if layer.bias is None else layer.bias.double())
    assert got.shape == (3, 11, shape[0]) and got.dtype == dtype
    # Each result within its rounding of the exact sum (float32 accumulates k products: a bound on its error).
    bound = (x.double().abs() @ want_weight.abs().T) * 1e-6 + want.abs() * ROUNDING[dtype]
    assert ((got.double() - want).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES[:4])
def test_a_row_is_the_same_bits_whatever_rows_and_threads_share_the_call(shape, dtype):
    layer = _layer(*shape, True, seed=2, dtype=dtype)
    packed = KernelLinear(layer)
    x = torch.randn(70, shape[1]).to(dtype)
    threads = torch.get_num_threads()
    with torch.no_grad():
        whole = packed(x)
        try:
            torch.set_num_threads(2)
            split = packed(x)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(split, whole)
        for start, stop in [(0, 1), (5, 6), (69, 70), (0, 13), (7, 20), (30, 70)]:
            assert torch.equal(packed(x[start:stop]), whole[start:stop]), (start, stop)
        # Rows that are a view into a wider tensor (a fused projection's slice) read the same.
        wide = torch.cat([x, torch.randn(70, 5).to(dtype)], dim=1)[:, :shape[1]]
        assert torch.equal(packed(wide), whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_s_linear_layers_are_packed_for_the_kernel(dtype):
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 32, bias=False)).to(dtype)
    packing = linear_packing(torch.device("cpu"), dtype)
    assert packing == "kernel" and pack_linears(model, packing) == 2
    assert all(isinstance(model[i], KernelLinear) for i in (0, 2))


def test_without_a_compiler_float32_falls_back_to_mkl(tmp_path):
    script = ("import torch; from actors.engine.model.cpu_linear import linear_packing; "
              "print(linear_packing(torch.device('cpu'), torch.float32))")
    env = {**os.environ, "CC": "/bin/false", "TANDEM_KERNEL_CACHE": str(tmp_path / "kernels")}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "mkl"


def test_rows_of_another_dtype_are_refused_not_misread():
    packed = KernelLinear(_layer(16, 32, True, seed=3))
    with pytest.raises(ValueError, match="float32 rows"):
        packed(torch.randn(2, 32, dtype=torch.float64))

