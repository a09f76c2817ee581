"""Triton's kernels (triton_attention.py, triton_fused.py) run on the CPU in Triton's interpreter here.
The switch is read when a kernel is decorated, at the first import of its module: set before any test
module of this folder imports one."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
