"""tandem's Triton paged decode kernel, run on the CPU in Triton's interpreter: the kernel against a plain
softmax over the gathered context (GQA, windows, Gemma 2's cap, a head size that is not a power of two),
the triton backend's engine against the SDPA one (greedy tokens, nothing left in the cache), and the
fixed-buffer decode step a CUDA graph replays, refilled for two different batches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is a dev dependency (pyproject.toml); CUDA builds of torch ship it")

from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import Engine  # noqa: E402
from actors.engine.model.decode_graphs import pad_decode  # noqa: E402
from actors.engine.model.runner import ModelRunner  # noqa: E402
from actors.engine.model.triton_attention import paged_decode_attention  # noqa: E402  (interpreted: conftest.py)
from actors.engine.model.triton_backend import TritonBackend, TritonDecodeStep  # noqa: E402
from actors.protocol.sampling_params import SamplingParams  # noqa: E402
from tests.helpers.models import make_hf_model  # noqa: E402


def _reference(q, k_cache, v_cache, tables, lens, scale, window, softcap, chunk=None):
    out = torch.empty_like(q)
    groups = q.shape[1] // k_cache.shape[2]
    for b, (table, n) in enumerate(zip(tables, lens)):
        k = k_cache[torch.tensor(table)].flatten(0, 1)[:n].repeat_interleave(groups, 1)
        v = v_cache[torch.tensor(table)].flatten(0, 1)[:n].repeat_interleave(groups, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k.double()) * scale
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        if window:
            s[:, torch.arange(n) < n - window] = float("-inf")
        if chunk:
            s[:, torch.arange(n) < (n - 1) // chunk * chunk] = float("-inf")
        out[b] = torch.einsum("ht,thd->hd", s.softmax(-1), v.double()).to(q.dtype)
    return out


@pytest.mark.parametrize("window,softcap,chunk", [(None, None, None), (7, None, None), (None, 0.5, None),
                                                  (6, 0.8, None), (None, None, 8), (12, None, 16)])
def test_kernel_matches_softmax_over_the_gathered_context(window, softcap, chunk):
    g = torch.Generator().manual_seed(0)
    block, num_blocks, heads, kv_heads, head_dim = 4, 40, 8, 2, 24  # 24: the kernel masks its padded lanes
    k_cache, v_cache = (torch.randn(num_blocks, block, kv_heads, head_dim, generator=g) for _ in range(2))
    q = torch.randn(4, heads, head_dim, generator=g)
    lens = [1, 5, 17, 33]  # one token, a partial block, block edges crossed, longer than a 32-token tile
    pages = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(pages[used: used + -(-n // block)])
        used += len(tables[-1])
    width = max(map(len, tables)) + 2  # wider than needed, as a graph's tables are: the tail must be ignored
    padded = torch.tensor([t + [num_blocks - 1] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    got = paged_decode_attention(q, k_cache, v_cache, padded, seq_lens, 0.3, window, softcap, chunk)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, lens, 0.3, window, softcap, chunk),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "llama4"])  # llama4's chunks of 8 bind on all three
def test_the_triton_engine_decodes_as_the_sdpa_engine(tmp_path, kind):
    model_dir = make_hf_model(tmp_path / kind, kind, seed=5)
    prompts = [list(range(2, 9)), list(range(30, 61)), [7] * 20]  # gemma2's window (12) binds on the last two
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for backend in ("sdpa", "triton"):
        engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=64, block_size=8, attention_backend=backend))
        assert engine.runner.attention.name == backend
        outputs[backend] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
        engine.check_integrity()
        assert engine.num_used_blocks == 0
    assert outputs["triton"] == outputs["sdpa"]


def test_a_graph_step_refilled_for_two_batches_gives_the_eager_logits(tmp_path):
    """The fixed-buffer step a CUDA graph replays (bucket of 4, padded with a spare block), planned for one
    batch and then another, gives the logits the SDPA path gives each batch unpadded."""
    block, spare = 8, 31
    runner = ModelRunner(str(make_hf_model(tmp_path / "llama", seed=2)), "float32", "cpu", block, num_kv_blocks=32,
                         kv_cache_memory_bytes=1, attention_backend="sdpa")
    triton = TritonBackend(block, runner.model.windows, runner.device)
    prompts = [list(range(3, 12)), list(range(50, 80)), list(range(90, 107))]
    tables = [[5, 1], [2, 9, 4, 0], [7, 3, 6]]
    runner.execute(sum(prompts, []), [len(p) for p in prompts], [0, 0, 0], tables, [0, 1, 2])
    step = triton.graph_step(4, max_pages_per_seq=6)
    assert isinstance(step, TritonDecodeStep) and step.fixed
    buffers = [t.data_ptr() for t in (step.positions, step.slot_mapping, step.block_tables, step.seq_lens)]
    for rows in ([0, 1, 2], [2, 0]):
        tokens, done, seq_tables = [11 + r for r in rows], [len(prompts[r]) for r in rows], [tables[r] for r in rows]
        saved = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
        eager = runner.execute(tokens, [1] * len(rows), done, seq_tables, list(range(len(rows))))
        for (k, v), (k0, v0) in zip(runner.kv_caches, saved):
            k.copy_(k0)
            v.copy_(v0)
        padded = pad_decode(tokens, done, seq_tables, 4, spare)
        step.plan(padded.query_lens, padded.computed_lens, padded.block_tables)
        with torch.inference_mode():
            logits = runner.model(torch.tensor(padded.token_ids), step, runner.kv_caches, torch.arange(4))
        torch.testing.assert_close(logits[: len(rows)], eager, rtol=1e-4, atol=1e-4)
        assert step.seq_lens.tolist()[: len(rows)] == [n + 1 for n in done]
    assert buffers == [t.data_ptr() for t in (step.positions, step.slot_mapping, step.block_tables, step.seq_lens)]
    with pytest.raises(ValueError, match="needs 7 pages; the step holds 6"):
        step.plan([1], [50], [list(range(7))])
