"""The engine's side of disaggregation, in one process: prefill hands off, decode adopts."""

from __future__ import annotations

import pytest
import torch

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams

BLOCK = 4


def _engine(model_dir) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_size=BLOCK, num_kv_blocks=96, detokenize=False))


def _copy_pages(src: Engine, src_blocks: list[int], dst: Engine, dst_blocks: list[int]) -> None:
    for (sk, sv), (dk, dv) in zip(src.runner.kv_caches, dst.runner.kv_caches):
        dk[dst_blocks] = sk[src_blocks]
        dv[dst_blocks] = sv[src_blocks]


def _disaggregated(model_dir, prompts, params):
    prefill, decode = _engine(model_dir), _engine(model_dir)
    tokens = {}
    for i, (p, s) in enumerate(zip(prompts, params)):
        prefill.add_request(f"r{i}", p, s, hand_off=True)
    while prefill.has_unfinished():
        for out in prefill.step():
            tokens[out.request_id] = list(out.new_token_ids)
            if out.status == RequestStatus.TRANSFERRING:
                i = int(out.request_id[1:])
                dest = decode.reserve(out.request_id, len(prompts[i]))
                _copy_pages(prefill, prefill.lease_blocks(out.request_id), decode, dest)
                decode.adopt(out.request_id, prompts[i], out.new_token_ids[0], params[i])
                assert prefill.release(out.request_id)
                assert not prefill.release(out.request_id)
    prefill.check_integrity()
    assert prefill.num_used_blocks == 0
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    decode.check_integrity()
    assert decode.num_used_blocks == 0
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_handoff_matches_one_engine(default_model_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 2048, (n,), generator=g).tolist() for n in (2, 5, 9, 17, 33)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),  # finishes on the prefill side: no handoff
        SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    single = _engine(default_model_dir)
    expected = [r.outputs[0].token_ids for r in single.generate(prompts, params)]
    assert _disaggregated(default_model_dir, prompts, params) == expected


def test_reservation_is_released_and_bounded(default_model_dir):
    decode = _engine(default_model_dir)
    blocks = decode.reserve("r", 10)
    assert len(blocks) == 3 and decode.num_used_blocks == 3
    with pytest.raises(ValueError, match="already"):
        decode.reserve("r", 10)
    assert decode.release("r") and not decode.release("r")
    assert decode.num_used_blocks == 0
    assert decode.reserve("big", 96 * BLOCK - 1) is not None  # fills the cache
    assert decode.reserve("nope", 8) is None  # no room: nothing held
    assert not decode.abort("big")  # a reservation is not a request: abort leaves it to its owner
    assert sorted(decode.lease_blocks("big")) == list(range(96))
    assert decode.release("big")
    decode.check_integrity()
    assert decode.num_used_blocks == 0


def test_adopt_checks_the_reserved_size(default_model_dir):
    decode = _engine(default_model_dir)
    decode.reserve("r", 6)
    with pytest.raises(ValueError, match="6 tokens reserved, 5 adopted"):
        decode.adopt("r", [11, 12, 13, 14, 15], 20, SamplingParams())
    assert decode.release("r")
    assert decode.num_used_blocks == 0
