"""BlockPool and the block hash: exact block ids, refcounts, free-queue order, events, integrity."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.engine.kv.block_hash import (
    extend_block_hashes,
    first_block_keys,
    hash_block,
    hash_prompt_blocks,
)
from actors.engine.kv.block_pool import BlockPool, OutOfBlocksError
from actors.protocol.kv_events import AllCleared, BlockRemoved, BlockStored

BS = 4


@pytest.fixture
def make_pool():
    made = []

    def make(num_blocks: int = 8, block_size: int = BS, enable_caching: bool = True) -> BlockPool:
        pool = BlockPool(num_blocks, block_size, enable_caching)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.check_integrity()


def toks(start: int, n: int = BS) -> list[int]:
    return list(range(start, start + n))


# ---- block hash ------------------------------------------------------------------------------


def test_hash_is_pinned_and_64_bit():
    # Golden values: if the encoding changes, bump _PERSON's version (router and workers must agree).
    assert hash_block(None, [1, 2, 3, 4]) == 4176343053726845113
    assert hash_block(None, [1, 2, 3, 4], first_block_keys("tenant-a", "m")) == 13053305751861082350
    h = hash_prompt_blocks(list(range(1000)), 16, None, "m")
    assert len(h) == 62 and len(set(h)) == 62
    assert all(0 <= x < 2**64 for x in h)


def test_hash_depends_on_parent_tokens_and_keys():
    base = hash_block(None, [1, 2, 3, 4])
    assert hash_block(base, [1, 2, 3, 4]) != base
    assert hash_block(None, [1, 2, 3, 5]) != base
    assert hash_block(None, [1, 2, 3, 4], ("x",)) != base
    assert hash_block(None, [1, 2, 3, 4], ()) == base
    # Unambiguous encoding: a str key and the same bytes key differ; 1 and True differ.
    assert hash_block(None, [1], ("a",)) != hash_block(None, [1], (b"a",))
    assert hash_block(None, [1], (1,)) != hash_block(None, [1], (True,))
    assert hash_block(None, [1], (("a", "b"),)) != hash_block(None, [1], ("a", "b"))
    with pytest.raises(TypeError, match="float"):
        hash_block(None, [1], (1.5,))


def test_salt_and_model_isolate_every_block():
    tokens = toks(0, 3 * BS)
    plain = hash_prompt_blocks(tokens, BS, None, "m")
    empty_salt = hash_prompt_blocks(tokens, BS, "", "m")
    tenant_a = hash_prompt_blocks(tokens, BS, "a", "m")
    tenant_b = hash_prompt_blocks(tokens, BS, "b", "m")
    other_model = hash_prompt_blocks(tokens, BS, "a", "m2")
    lists = [plain, empty_salt, tenant_a, tenant_b, other_model]
    for i, x in enumerate(lists):
        for y in lists[i + 1 :]:
            assert all(a != b for a, b in zip(x, y, strict=True))
    assert hash_prompt_blocks(tokens, BS, "a", "m") == tenant_a


def test_hash_prompt_blocks_full_blocks_only_and_incremental():
    tokens = toks(100, 2 * BS + 3)
    full = hash_prompt_blocks(tokens, BS, "t", "m")
    assert len(full) == 2
    assert full[0] == hash_block(None, tokens[:BS], first_block_keys("t", "m"))
    assert full[1] == hash_block(full[0], tokens[BS : 2 * BS])
    start = full[:1]
    grown = tokens + [7, 8, 9, 10, 11]
    extended = hash_prompt_blocks(grown, BS, "t", "m", start_hashes=start)
    assert start == full[:1]  # not mutated
    assert extended == hash_prompt_blocks(grown, BS, "t", "m")
    assert len(extended) == 4 and extended[:2] == full
    in_place = list(full)
    assert extend_block_hashes(in_place, grown, BS, first_block_keys("t", "m")) == 2
    assert in_place == extended
    assert extend_block_hashes(in_place, grown, BS, first_block_keys("t", "m")) == 0


def test_hash_is_deterministic_across_processes():
    code = (
        "from actors.engine.kv.block_hash import hash_prompt_blocks;"
        "print(hash_prompt_blocks(list(range(50)), 8, 'tenant', 'model-x'))"
    )
    outs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        cmd = [sys.executable, "-c", code]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        outs.append(done.stdout.strip())
    assert outs[0] == outs[1] == str(hash_prompt_blocks(list(range(50)), 8, "tenant", "model-x"))


# ---- pool ------------------------------------------------------------------------------------


def test_allocate_pops_head_in_id_order(make_pool):
    pool = make_pool(8)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0 and pool.usage == 0.0
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    assert pool.usage == pytest.approx(3 / 8)
    assert pool.allocate(0) == []
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    pool.free([2, 1, 0])
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.allocate(6) == [3, 4, 5, 6, 7, 2]


def test_allocate_too_many_raises_and_changes_nothing(make_pool):
    pool = make_pool(4)
    pool.allocate(3)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks, only 1 free"):
        pool.allocate(2)
    assert pool.free_block_ids() == [3]
    assert pool.num_used_blocks == 3
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.free([0, 1, 2])


def test_double_free_and_touch_of_plain_free_block_raise(make_pool):
    pool = make_pool(4)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(RuntimeError, match="free and not cached"):
        pool.touch([b])
    assert pool.num_used_blocks == 0


def test_cache_lookup_compares_tokens(make_pool):
    pool = make_pool(4)
    b0, b1 = pool.allocate(2)
    assert pool.cache_block(b0, 111, toks(0)) is True
    assert pool.lookup(111, toks(0)) == b0
    assert pool.lookup(111, tuple(toks(0))) == b0
    assert pool.lookup(111, toks(1)) is None  # same hash, other tokens: a collision is a miss
    assert pool.lookup(222, toks(0)) is None
    assert pool.block_hash(b0) == 111 and pool.block_hash(b1) is None
    # Idempotent for the same block and hash; a second block with a taken hash stays uncached.
    assert pool.cache_block(b0, 111, toks(0)) is False
    assert pool.cache_block(b1, 111, toks(0)) is False
    assert pool.block_hash(b1) is None and pool.lookup(111, toks(0)) == b0
    assert pool.num_cached_blocks == 1
    with pytest.raises(RuntimeError, match="cached under"):
        pool.cache_block(b0, 333, toks(0))
    with pytest.raises(RuntimeError, match="3 tokens"):
        pool.cache_block(b1, 444, [1, 2, 3])
    pool.free([b1, b0])
    with pytest.raises(RuntimeError, match="not held"):
        pool.cache_block(b1, 555, toks(0))


def test_cached_free_block_is_revived_by_touch(make_pool):
    pool = make_pool(4)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, 10, toks(0))
    pool.free([b1, b0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.num_free_blocks == 4  # cached-but-evictable blocks count as free
    assert pool.lookup(10, toks(0)) == 0
    pool.touch([0])
    assert pool.ref_count(0) == 1 and pool.free_block_ids() == [2, 3, 1]
    pool.touch([0])
    assert pool.ref_count(0) == 2
    pool.free([0])
    assert pool.ref_count(0) == 1 and pool.free_block_ids() == [2, 3, 1]
    pool.free([0])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.block_hash(0) == 10


def test_eviction_is_lru_and_emits_removed(make_pool):
    pool = make_pool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, 100 + i, toks(10 * i), parent_hash=100 + i - 1 if i else None)
    assert pool.take_events() == [
        BlockStored(100, None, BS),
        BlockStored(101, 100, BS),
        BlockStored(102, 101, BS),
        BlockStored(103, 102, BS),
    ]
    assert pool.take_events() == []
    pool.free([1, 0])  # first sequence's blocks, reversed
    pool.free([3, 2])
    assert pool.free_block_ids() == [1, 0, 3, 2]
    assert pool.allocate(2) == [1, 0]
    assert pool.take_events() == [BlockRemoved(101), BlockRemoved(100)]
    assert pool.lookup(100, toks(0)) is None and pool.lookup(101, toks(10)) is None
    assert pool.lookup(102, toks(20)) == 2
    assert pool.block_hash(0) is None and pool.ref_count(0) == 1
    assert pool.num_cached_blocks == 2
    # A reused block can be cached again under a new hash.
    assert pool.cache_block(0, 200, toks(50)) is True
    pool.free([0, 1])
    assert pool.num_used_blocks == 0


def test_reset_prefix_cache(make_pool):
    pool = make_pool(4)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 7, toks(0))
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.lookup(7, toks(0)) == b
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllCleared()]
    assert pool.lookup(7, toks(0)) is None and pool.num_cached_blocks == 0
    assert pool.allocate(1) == [1]
    assert pool.take_events() == []  # no BlockRemoved for an already cleared block
    pool.free([1])


def test_caching_disabled(make_pool):
    pool = make_pool(4, enable_caching=False)
    (b,) = pool.allocate(1)
    assert pool.cache_block(b, 7, toks(0)) is False
    assert pool.lookup(7, toks(0)) is None
    assert pool.take_events() == []
    pool.free([b])


def test_check_integrity_catches_corruption(make_pool):
    pool = make_pool(4)
    pool.allocate(2)
    pool.cache_block(0, 9, toks(0))
    pool.check_integrity()
    pool._ref[3] = 1  # a free-queue block that claims a holder
    with pytest.raises(RuntimeError, match=r"free 2 \+ used 3 != total 4.*held"):
        pool.check_integrity()
    pool._ref[3] = 0
    pool._hash[1] = 9  # a second block claiming a cached hash
    with pytest.raises(RuntimeError, match="2 blocks carry a hash but the hash map has 1"):
        pool.check_integrity()
    pool._hash[1] = None
    pool._cached[9] = 1  # the map points at a block with another hash
    with pytest.raises(RuntimeError, match="1 hash-map entries"):
        pool.check_integrity()
    pool._cached[9] = 0
    pool.check_integrity()
    pool.free([1, 0])
