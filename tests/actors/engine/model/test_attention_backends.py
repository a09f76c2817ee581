"""The attention-backend seam and the decode-graph padding, as far as they run without a GPU: which backend
a runner picks and why, FlashInfer's page-table arithmetic against the cache slots the SDPA path writes,
the graph buckets, and a padded decode step leaving the real rows' logits and KV exactly as an unpadded
one does. The kernels themselves run in tests/gpu/test_gpu.py."""

from __future__ import annotations

import logging

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.model.attention import SdpaBackend
from actors.engine.model.attention_backend import LayerAttention, positions_and_slots
from actors.engine.model.backend_choice import choose_attention_backend
from actors.engine.model.cpu_paged_backend import CpuPagedBackend, CpuPagedStep
from actors.engine.model.decode_graphs import bucket_for, graph_buckets, pad_decode
from actors.engine.model.flashinfer_backend import paged_kv_indexes, refusal
from actors.engine.model.loader import load_model
from actors.engine.model.runner import ModelRunner
from tests.helpers.models import make_hf_model

CPU = torch.device("cpu")
LLAMA_LAYER = LayerAttention(num_heads=32, num_kv_heads=8, head_dim=128, scale=128**-0.5, window=None, softcap=None)


def test_refusal_names_what_flashinfer_cannot_serve():
    assert refusal(LLAMA_LAYER, torch.bfloat16) is None
    assert refusal(LLAMA_LAYER, torch.float16) is None
    assert "float32" in refusal(LLAMA_LAYER, torch.float32)
    odd = LayerAttention(12, 4, 80, 80**-0.5, None, None)
    assert "head_dim 80" in refusal(odd, torch.bfloat16)
    # Windows and Gemma 2's cap are plan parameters of FlashInfer's kernels, not refusals.
    assert refusal(LayerAttention(8, 4, 256, 0.06, 4096, 50.0), torch.bfloat16) is None
    assert "chunked attention" in refusal(LayerAttention(8, 4, 128, 0.09, None, None, 8192), torch.bfloat16)


def test_cpu_runs_its_kernel_and_an_explicit_gpu_backend_is_an_error(caplog, monkeypatch):
    layers = (LLAMA_LAYER,)
    with caplog.at_level(logging.WARNING):
        assert isinstance(choose_attention_backend("auto", layers, (None,), 16, torch.float32, CPU), CpuPagedBackend)
        assert isinstance(choose_attention_backend("cpu", layers, (None,), 16, torch.bfloat16, CPU), CpuPagedBackend)
    assert not caplog.records  # auto on a CPU is no surprise: nothing to warn about
    assert isinstance(choose_attention_backend("sdpa", layers, (None,), 16, torch.bfloat16, CPU), SdpaBackend)
    with pytest.raises(ValueError, match="flashinfer.*CUDA device.*cpu"):
        choose_attention_backend("flashinfer", layers, (None,), 16, torch.bfloat16, CPU)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (test_triton_attention.py sets it)
    with pytest.raises(ValueError, match="'triton' cannot run here: .*CUDA device.*TRITON_INTERPRET=1"):
        choose_attention_backend("triton", layers, (None,), 16, torch.float32, CPU)
    with pytest.raises(ValueError, match="attention_backend='xformers': must be one of auto, sdpa, cpu, flashinfer, triton"):
        choose_attention_backend("xformers", layers, (None,), 16, torch.bfloat16, CPU)
    with pytest.raises(ValueError, match="attention_backend='xformers'"):
        EngineConfig(model="m", attention_backend="xformers")


def test_the_config_reaches_the_runner(tmp_path, caplog):
    model_dir = make_hf_model(tmp_path / "llama")
    with pytest.raises(ValueError, match="flashinfer.*cannot run here"):
        ModelRunner.from_config(EngineConfig(model=str(model_dir), num_kv_blocks=8, attention_backend="flashinfer"))
    with caplog.at_level(logging.INFO, logger="actors.engine.model.runner"):
        runner = ModelRunner.from_config(EngineConfig(model=str(model_dir), num_kv_blocks=8))
    assert runner.attention.name == "cpu" and runner.graphs is None
    assert any("CUDA graphs skipped: this engine runs on cpu" in r.getMessage() for r in caplog.records)
    assert runner.kv_caches[0][0].shape[0] == 8  # no padding block without graphs
    off = ModelRunner.from_config(EngineConfig(model=str(model_dir), num_kv_blocks=8, cuda_graphs=False))
    assert off.graphs is None


def test_layer_attentions_are_the_distinct_kinds(tmp_path):
    gemma = load_model(make_hf_model(tmp_path / "g2", "gemma2"))
    kinds = gemma.layer_attentions()
    assert {k.window for k in kinds} == {12, None} and {k.softcap for k in kinds} == {0.5}
    assert all(k.scale == 24**-0.5 and k.head_dim == 16 for k in kinds)
    assert len(load_model(make_hf_model(tmp_path / "l", "llama")).layer_attentions()) == 1


def test_flashinfer_page_tables_cover_the_slots_the_step_writes():
    block = 4
    query_lens, computed_lens = [5, 1, 3, 1], [0, 8, 4, 3]  # fresh, decode at a block edge, chunk, decode
    tables = [[9, 2], [7, 1, 3, 11], [0, 6], [5]]
    qo, kv_indptr, kv_indices, last = paged_kv_indexes(query_lens, computed_lens, tables, block)
    assert qo.tolist() == [0, 5, 6, 9, 10]
    assert kv_indptr.tolist() == [0, 2, 5, 7, 8]  # 5, 9, 7, 4 tokens of context
    assert kv_indices.tolist() == [9, 2, 7, 1, 3, 0, 6, 5]
    assert last.tolist() == [1, 1, 3, 4]
    assert {t.dtype for t in (qo, kv_indptr, kv_indices, last)} == {torch.int32}
    # Every new token's slot is in its own sequence's pages, at its position within the context.
    positions, slots = positions_and_slots(query_lens, computed_lens, tables, block)
    seq_of_token = [i for i, q in enumerate(query_lens) for _ in range(q)]
    for pos, slot, seq in zip(positions.tolist(), slots.tolist(), seq_of_token):
        pages = kv_indices[kv_indptr[seq]:kv_indptr[seq + 1]].tolist()
        assert slot == pages[pos // block] * block + pos % block


def test_graph_buckets():
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(10) == (1, 2, 4, 8, 10)
    assert graph_buckets(1) == (1,)
    buckets = graph_buckets(20)
    assert [bucket_for(n, buckets) for n in (1, 3, 5, 8, 9, 17, 20, 21)] == [1, 4, 8, 8, 16, 20, 20, None]
    with pytest.raises(ValueError, match="5 sequences do not fit a bucket of 4"):
        pad_decode([1] * 5, [3] * 5, [[0]] * 5, 4, 9)


def test_a_padded_decode_step_leaves_the_real_rows_as_they_were(tmp_path):
    """Three sequences decode one token, alone and padded to a bucket of 8 whose padding writes one spare
    block: the real rows' logits and every other block of the cache come out the same."""
    block, pad_block = 8, 15
    runner = ModelRunner(str(make_hf_model(tmp_path / "llama")), "float32", "cpu", block, num_kv_blocks=16,
                         kv_cache_memory_bytes=1, max_num_seqs=8)
    prompts = [list(range(3, 20)), list(range(40, 49)), list(range(100, 130))]
    tables = [[4, 0, 9], [2, 5], [1, 3, 6, 7]]
    runner.execute(sum(prompts, []), [len(p) for p in prompts], [0, 0, 0], tables, [0, 1, 2])
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    step = ([7, 8, 9], [len(p) for p in prompts], tables)

    alone = runner.execute(step[0], [1, 1, 1], *step[1:], [0, 1, 2])
    after_alone = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):  # back to the cache the step started from
        k.copy_(k0)
        v.copy_(v0)

    padded = pad_decode(*step, bucket_for(3, graph_buckets(8)), pad_block)
    assert (padded.real, len(padded.token_ids), padded.block_tables[3:]) == (3, 4, [[pad_block]])
    batch = runner.attention.prepare(padded.query_lens, padded.computed_lens, padded.block_tables)
    assert isinstance(batch, CpuPagedStep) and batch.short.query_starts.tolist() == [0, 1, 2, 3]  # 4 decodes
    logits = runner.execute(padded.token_ids, padded.query_lens, padded.computed_lens, padded.block_tables,
                            list(range(4)))
    torch.testing.assert_close(logits[:3], alone, rtol=1e-5, atol=1e-5)
    assert logits[:3].argmax(-1).tolist() == alone.argmax(-1).tolist()
    # The step's own K/V (one slot in each sequence's last block) within float rounding: a matmul of 4 rows
    # may round differently from one of 3 (seen on AMD EPYC); every block the step did not write, exactly.
    written = [table[length // block] for table, length in zip(tables, step[1])]
    untouched = [b for b in range(16) if b != pad_block and b not in written]
    for (k, v), (ka, va) in zip(runner.kv_caches, after_alone):
        assert torch.equal(k[untouched], ka[untouched]) and torch.equal(v[untouched], va[untouched])
        torch.testing.assert_close((k[written], v[written]), (ka[written], va[written]), rtol=1e-5, atol=1e-5)
        assert k[pad_block, 1].abs().sum() > 0  # the padding row wrote its K at position 1 of the spare block
