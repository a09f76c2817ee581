"""tandem's CPU attention kernels (csrc/paged_attention_cpu.c for decodes and short runs,
prefill_attention_cpu.c for prompts and chunks, through cpu_paged_backend.py) against the reference SDPA
path on the same mixed steps: decodes at many context lengths, short runs after a cached
context, fresh prompts beside them, sliding windows, Gemma 2's softcap, Llama 4's attention chunks, GQA
from 1 to 8 query heads per kv head, block tables in scattered order; float32 to 2e-6, bfloat16 to its
rounding. And the backend choice when the kernel cannot be built."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from actors.engine.model.attention import SdpaBackend
from actors.engine.model.attention_backend import LayerAttention
from actors.engine.model.cpu_paged_backend import KERNEL_MAX_QUERY, CpuPagedBackend, why_not_cpu

CPU = torch.device("cpu")
# Worst output difference seen against SDPA over these cases: 1.2e-6 (float32; the kernel's exp is a
# polynomial to ~2e-7 and its sums run in another order) and one bfloat16 rounding step of outputs of
# magnitude up to ~2 (2^-6 = 0.016).
F32_TOLERANCE, BF16_TOLERANCE = 2e-6, 0.02


def _step(query_lens, computed_lens, *, heads=9, kv_heads=3, head_dim=64, block_size=16, window=None,
          softcap=None, sinks=None, dtype=torch.float32, threads=1, seed=0, chunk=None):
    """Both backends' output for one step on the same caches; the caches after each step, too."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(q + d) // block_size) for q, d in zip(query_lens, computed_lens)]
    free = list(range(sum(blocks_needed) + 5))
    rng.shuffle(free)  # a sequence's blocks anywhere in the cache, in any order
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    tokens = sum(query_lens)
    num_blocks = sum(blocks_needed) + 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k, v = randn(tokens, heads, head_dim), randn(tokens, kv_heads, head_dim), randn(tokens, kv_heads, head_dim)
    k_cache, v_cache = randn(num_blocks, block_size, kv_heads, head_dim), randn(num_blocks, block_size, kv_heads, head_dim)
    layer = LayerAttention(heads, kv_heads, head_dim, head_dim**-0.5, window, softcap, chunk=chunk, sinks=sinks)
    outputs, caches = [], []
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for backend in (SdpaBackend(block_size, (window,), CPU), CpuPagedBackend(block_size)):
            kc, vc = k_cache.clone(), v_cache.clone()
            step = backend.prepare(query_lens, computed_lens, tables)
            outputs.append(step.attend(q, k, v, kc, vc, layer).float())
            caches.append((kc, vc))
        # What both approximate: the reference path in float32 over the same (rounded) inputs.
        step = SdpaBackend(block_size, (window,), CPU).prepare(query_lens, computed_lens, tables)
        outputs.append(step.attend(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), layer))
    finally:
        torch.set_num_threads(previous)
    return outputs, caches


def assert_close_to_reference(outputs, dtype):
    """float32: the kernel within F32_TOLERANCE of SDPA. bfloat16: the kernel within one output rounding
    of the float32 answer over the same inputs, and never further from it than SDPA in bfloat16 is by more
    than that (SDPA rounds scores and weights to bfloat16 on the way: up to 0.02 off with a softcap of 50)."""
    reference, kernel, truth = outputs
    if dtype == torch.float32:
        assert (reference - kernel).abs().max().item() <= F32_TOLERANCE
        return
    kernel_error, reference_error = (kernel - truth).abs().max().item(), (reference - truth).abs().max().item()
    assert kernel_error <= BF16_TOLERANCE, (kernel_error, reference_error)
    assert kernel_error <= reference_error + BF16_TOLERANCE, (kernel_error, reference_error)


MIXED = [
    ([1] * 16, [2047 - 37 * i for i in range(16)]),  # decodes at 16 context lengths, block edges among them
    ([300, 21, 22, 1], [0, 0, 500, 40]),  # prompts and a chunk across the prefill kernel's tiles of 21 tokens
    ([1, 3, 40, 1, 2, 100], [5, 900, 200, 16, 31, 0]),  # decodes, short runs, a long chunk, a fresh prompt
    ([4, 4], [1, 4000]),
    ([1], [0 + 1]),  # the second token of a sequence
]


@pytest.mark.parametrize("query_lens,computed_lens", MIXED)
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (None, 30.0), (7, 50.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_attends_as_sdpa_does(query_lens, computed_lens, window, softcap, dtype):
    outputs, caches = _step(query_lens, computed_lens, window=window, softcap=softcap, dtype=dtype)
    assert_close_to_reference(outputs, dtype)
    for (k_ref, v_ref), (k_cpu, v_cpu) in zip(caches[:1], caches[1:]):
        assert torch.equal(k_ref, k_cpu) and torch.equal(v_ref, v_cpu)  # the new K/V land in the same slots


@pytest.mark.parametrize("query_lens,computed_lens", MIXED)
@pytest.mark.parametrize("chunk,window", [(16, None), (100, None), (40, 25)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_keeps_to_attention_chunks_as_sdpa_does(query_lens, computed_lens, chunk, window, dtype):
    """Llama 4's local layers: a query sees only its own chunk's keys (runs of 4 cross chunk edges)."""
    outputs, _ = _step(query_lens, computed_lens, window=window, chunk=chunk, dtype=dtype)
    assert_close_to_reference(outputs, dtype)


@pytest.mark.parametrize("query_lens,computed_lens", MIXED)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_takes_attention_sinks_as_sdpa_does(query_lens, computed_lens, window, dtype):
    """gpt-oss's sink logits, one per query head, from below the scores to far above them."""
    sinks = tuple(torch.linspace(-3.0, 10.0, 9).tolist())
    outputs, _ = _step(query_lens, computed_lens, window=window, sinks=sinks, dtype=dtype)
    assert_close_to_reference(outputs, dtype)
    reference = outputs[0]
    (without, _, _), _ = _step(query_lens, computed_lens, window=window, dtype=dtype)
    assert (reference - without).abs().max() > 0.1 * without.abs().max()  # the sinks changed the output


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (8, 8, 64, 16),  # no GQA
    (32, 4, 128, 16),  # 8 query heads per kv head, Llama's head size
    (16, 2, 256, 32),  # Gemma's head size, bigger blocks
    (12, 4, 80, 16),  # a head size the unrolled paths do not cover
    (64, 1, 16, 8),  # every head on one kv head: one work item's rows at the limit
])
@pytest.mark.parametrize("query_lens,computed_lens", [([1, 1, 2, 1], [300, 17, 64, 1000]),  # the decode kernel
                                                       ([70, 5, 33], [0, 100, 16])])  # the prefill kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16 head_dim 80 and 16: widened rows
def test_head_layouts(heads, kv_heads, head_dim, block_size, query_lens, computed_lens, dtype):
    outputs, _ = _step(query_lens, computed_lens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)
    assert_close_to_reference(outputs, dtype)


@pytest.mark.parametrize("query_lens", [[1], [1] * 2, [1] * 40, [200], [30, 90]])
def test_threads_split_the_work_without_changing_it(query_lens):
    """One sequence splits into an item per kv head across threads; many take all heads each; a prompt's
    tiles of query tokens go to either thread."""
    computed = [500 + 13 * i for i in range(len(query_lens))]
    (_, one, _), _ = _step(query_lens, computed, threads=1)
    (_, two, _), _ = _step(query_lens, computed, threads=2)
    assert torch.equal(one, two)


def test_decodes_and_short_runs_go_to_the_decode_kernel_prompts_and_chunks_to_the_prefill_kernel():
    step = CpuPagedBackend(16).prepare([1, KERNEL_MAX_QUERY, KERNEL_MAX_QUERY + 1, 20, 3], [30, 30, 30, 0, 0],
                                       [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11], [12]])
    assert step.short.query_lens.tolist() == [1, KERNEL_MAX_QUERY]
    assert step.short.query_starts.tolist() == [0, 1]
    assert step.short.context_lens.tolist() == [31, 30 + KERNEL_MAX_QUERY]
    assert step.long.query_lens.tolist() == [KERNEL_MAX_QUERY + 1, 20, 3]
    assert step.long.query_starts.tolist() == [1 + KERNEL_MAX_QUERY, 2 + 2 * KERNEL_MAX_QUERY, 22 + 2 * KERNEL_MAX_QUERY]
    assert step.long.context_lens.tolist() == [35, 20, 3]
    assert step.long.block_tables.tolist() == [[7, 8, 9], [10, 11, 0], [12, 0, 0]]


def test_shapes_the_kernel_cannot_take_are_named():
    odd = LayerAttention(12, 4, 72, 72**-0.5, None, None)
    assert "head_dim 72" in why_not_cpu((odd,), torch.float32, CPU)
    assert "float16" in why_not_cpu((LayerAttention(8, 8, 64, 0.125, None, None),), torch.float16, CPU)


def test_without_a_compiler_auto_falls_back_to_sdpa_and_cpu_is_an_error(tmp_path):
    """A fresh process with no usable C compiler and an empty kernel cache: auto warns and runs SDPA; an
    explicit `cpu` names why it cannot."""
    script = """
import logging, torch
from actors.engine.model.attention_backend import LayerAttention
from actors.engine.model.backend_choice import choose_attention_backend
logging.basicConfig(level=logging.WARNING)
layers = (LayerAttention(8, 8, 64, 0.125, None, None),)
print("auto:", choose_attention_backend("auto", layers, (None,), 16, torch.float32, torch.device("cpu")).name)
try:
    choose_attention_backend("cpu", layers, (None,), 16, torch.float32, torch.device("cpu"))
except ValueError as e:
    print("cpu:", e)
"""
    env = {**os.environ, "CC": "/bin/false", "TANDEM_KERNEL_CACHE": str(tmp_path / "kernels")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))))
    assert done.returncode == 0, done.stderr
    assert "auto: sdpa" in done.stdout
    assert "attention runs on SDPA: not the CPU kernel: /bin/false failed to build" in done.stderr
    assert "cpu: engine attention_backend='cpu' cannot run here: /bin/false failed to build" in done.stdout


def test_the_cache_on_huge_pages_is_zeroed_and_huge_where_the_kernel_allows():
    from pathlib import Path

    from actors.engine.model.cpu_allocator import zeros_on_huge_pages

    def huge_kb() -> int:
        return int(Path("/proc/self/smaps_rollup").read_text().split("AnonHugePages:")[1].split()[0])

    before = huge_kb()
    cache = zeros_on_huge_pages((1024, 16, 4, 64), torch.float32)  # 16 MiB
    assert cache.shape == (1024, 16, 4, 64) and not cache.any()
    cache.fill_(1.0)  # its pages come into being as it is written (reads map the shared zero page)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in thp:
        assert huge_kb() - before >= 16 * 1024  # all of it on 2 MiB pages
