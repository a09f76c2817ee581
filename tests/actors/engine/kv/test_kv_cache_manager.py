"""KVCacheManager: prefix hits, the recompute rule, all-or-nothing allocation, fork, free, events."""

from __future__ import annotations

import pytest

import actors.engine.kv.block_hash as block_hash_module
from actors.engine.kv.block_hash import hash_prompt_blocks
from actors.engine.kv.block_pool import OutOfBlocksError
from actors.engine.kv.cache_manager import KVCacheManager
from actors.protocol.kv_events import BlockRemoved, BlockStored

BS = 4
MODEL = "test-model"


@pytest.fixture
def make_manager():
    made = []

    def make(num_blocks: int = 16, enable_prefix_caching: bool = True, model_id: str = MODEL):
        mgr = KVCacheManager(num_blocks, BS, enable_prefix_caching, model_id)
        made.append(mgr)
        return mgr

    yield make
    for mgr in made:
        mgr.check_integrity()


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def prefill(mgr: KVCacheManager, seq_id, tokens: list[int], salt: str | None = None) -> int:
    """New sequence: prefix lookup, slots for the whole prompt, cache what became full."""
    cached = mgr.get_computed_blocks(seq_id, tokens, salt)
    assert mgr.allocate_slots(seq_id, len(tokens)) is not None
    mgr.cache_computed(seq_id, tokens, len(tokens), salt)
    mgr.check_integrity()
    return cached


def refs(mgr: KVCacheManager, blocks) -> list[int]:
    return [mgr.pool.ref_count(b) for b in blocks]


def free_all(mgr: KVCacheManager, *seq_ids) -> None:
    for s in seq_ids:
        mgr.free(s)
    mgr.check_integrity()
    assert mgr.pool.num_used_blocks == 0


def test_prefix_hit_shares_blocks(make_manager):
    mgr = make_manager(16)
    a = toks(0, 3 * BS + 2)  # 3 full blocks + 2 tokens
    assert mgr.get_computed_blocks("a", a, None) == 0
    assert mgr.block_table("a") == []
    assert mgr.allocate_slots("a", len(a)) == [0, 1, 2, 3]
    mgr.cache_computed("a", a, len(a), None)
    h = hash_prompt_blocks(a, BS, None, MODEL)
    assert mgr.take_events() == [
        BlockStored(h[0], None, BS),
        BlockStored(h[1], h[0], BS),
        BlockStored(h[2], h[1], BS),
    ]
    assert [mgr.pool.block_hash(b) for b in range(4)] == [*h, None]

    b = a[: 2 * BS + 1] + [999] * 6  # shares 2 full blocks, then diverges inside block 2
    assert mgr.get_computed_blocks("b", b, None) == 2 * BS
    assert mgr.block_table("b") == [0, 1]
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert mgr.allocate_slots("b", len(b)) == [4, 5]
    assert mgr.block_table("b") == [0, 1, 4, 5]
    mgr.cache_computed("b", b, len(b), None)
    hb = hash_prompt_blocks(b, BS, None, MODEL)
    assert hb[:2] == h[:2] and hb[2] != h[2]
    assert mgr.take_events() == [BlockStored(hb[2], hb[1], BS)]
    mgr.check_integrity()

    mgr.free("a")
    assert mgr.pool.free_block_ids() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 3, 2]
    assert refs(mgr, [0, 1, 2, 3]) == [1, 1, 0, 0]
    mgr.free("b")
    assert mgr.pool.free_block_ids()[-6:] == [3, 2, 5, 4, 1, 0]
    free_all(mgr)


def test_fully_cached_prompt_recomputes_last_token(make_manager):
    mgr = make_manager(16)
    prompt = toks(0, 2 * BS)
    assert prefill(mgr, "a", prompt) == 0
    free_all(mgr, "a")
    # Both blocks hit, but the last token must be recomputed: the last hit is dropped.
    assert mgr.get_computed_blocks("b", prompt, None) == BS
    assert mgr.block_table("b") == [0]
    assert mgr.allocate_slots("b", len(prompt)) == [2]  # head of the free queue, not cached block 1
    mgr.cache_computed("b", prompt, len(prompt), None)
    assert mgr.pool.block_hash(2) is None  # block 1 still holds that hash: block 2 stays uncached
    # One token more than the cache: both blocks hit.
    assert mgr.get_computed_blocks("c", prompt + [77], None) == 2 * BS
    assert mgr.block_table("c") == [0, 1]
    # A prompt shorter than one block, or empty, never hits.
    assert mgr.get_computed_blocks("d", prompt[:BS], None) == 0
    assert mgr.get_computed_blocks("e", [], None) == 0
    free_all(mgr, "b", "c", "d", "e")


def test_hash_collision_is_a_miss(make_manager, monkeypatch):
    monkeypatch.setattr(block_hash_module, "hash_block", lambda parent, tokens, extra=(): 42)
    mgr = make_manager(16)
    a = toks(0, 2 * BS + 1)
    assert prefill(mgr, "a", a) == 0
    # Block 1 collides with block 0's hash; the existing entry is kept, block 1 stays uncached.
    assert mgr.take_events() == [BlockStored(42, None, BS)]
    assert [mgr.pool.block_hash(b) for b in range(3)] == [42, None, None]
    other = toks(500, 2 * BS + 1)
    assert mgr.get_computed_blocks("b", other, None) == 0  # hash hit, tokens differ
    # Block 0 hits; block 1's lookup finds block 0's tokens under the same hash: a miss.
    assert mgr.get_computed_blocks("c", a, None) == BS
    assert mgr.block_table("c") == [0]
    free_all(mgr, "a", "b", "c")


def test_salt_and_model_isolation(make_manager):
    mgr = make_manager(16)
    prompt = toks(0, 2 * BS + 1)
    assert prefill(mgr, "a", prompt, salt="tenant-a") == 0
    assert mgr.get_computed_blocks("b", prompt, "tenant-b") == 0
    assert mgr.get_computed_blocks("c", prompt, None) == 0
    assert mgr.get_computed_blocks("d", prompt, "tenant-a") == 2 * BS
    free_all(mgr, "a", "b", "c", "d")

    other_model = make_manager(16, model_id="other-model")
    prefill(other_model, "a", prompt, salt="tenant-a")
    hashes = [e.block_hash for e in mgr.take_events()]
    other = [e.block_hash for e in other_model.take_events()]
    assert len(hashes) == len(other) == 2 and not set(hashes) & set(other)
    free_all(other_model, "a")


def test_allocate_slots_is_all_or_nothing(make_manager):
    mgr = make_manager(4)
    assert mgr.allocate_slots("a", 3 * BS) == [0, 1, 2]
    assert mgr.allocate_slots("a", 3 * BS) == []  # already covered
    assert mgr.allocate_slots("a", 3 * BS + 1) == [3]
    assert mgr.num_new_blocks_needed("a", 5 * BS + 1) == 2
    assert mgr.allocate_slots("a", 5 * BS + 1) is None
    assert mgr.block_table("a") == [0, 1, 2, 3] and mgr.num_free_blocks == 0
    assert mgr.allocate_slots("new", 1) is None
    assert not mgr.has("new")
    mgr.check_integrity()
    free_all(mgr, "a")
    assert mgr.pool.free_block_ids() == [3, 2, 1, 0]


def test_touched_cached_blocks_are_not_counted_as_free(make_manager):
    mgr = make_manager(6)
    prompt = toks(0, 3 * BS + 1)
    prefill(mgr, "a", prompt)  # blocks 0, 1, 2 cached, 3 partial
    assert len(mgr.take_events()) == 3
    mgr.free("a")
    assert mgr.pool.free_block_ids() == [4, 5, 3, 2, 1, 0]
    assert mgr.num_free_blocks == 6
    assert mgr.get_computed_blocks("b", prompt, None) == 3 * BS
    assert mgr.num_free_blocks == 3 and mgr.pool.free_block_ids() == [4, 5, 3]
    assert mgr.allocate_slots("b", 7 * BS) is None  # needs 4 more, 3 free: hits are not reusable
    assert mgr.block_table("b") == [0, 1, 2]
    assert mgr.allocate_slots("b", 6 * BS) == [4, 5, 3]
    assert mgr.take_events() == []  # block 3 was never cached: nothing evicted
    assert refs(mgr, range(6)) == [1] * 6
    free_all(mgr, "b")


def test_eviction_drops_hash_and_emits_removed(make_manager):
    mgr = make_manager(4)
    prompt = toks(0, 2 * BS + 1)
    prefill(mgr, "a", prompt)  # blocks 0, 1 cached, 2 partial
    h = hash_prompt_blocks(prompt, BS, None, MODEL)
    mgr.take_events()
    mgr.free("a")
    assert mgr.pool.free_block_ids() == [3, 2, 1, 0]
    assert mgr.allocate_slots("big", 3 * BS) == [3, 2, 1]  # LRU: the sequence's tail goes first
    assert mgr.take_events() == [BlockRemoved(h[1])]
    assert mgr.get_computed_blocks("b", prompt, None) == BS  # block 0 still cached
    assert mgr.block_table("b") == [0]
    free_all(mgr, "big", "b")


def test_cache_computed_is_incremental_and_idempotent(make_manager):
    mgr = make_manager(16)
    tokens = toks(0, BS + 2)
    mgr.get_computed_blocks("a", tokens, "t")
    mgr.allocate_slots("a", len(tokens))
    mgr.cache_computed("a", tokens, 3, "t")  # chunked prefill: nothing full and computed yet
    assert mgr.take_events() == []
    mgr.cache_computed("a", tokens, len(tokens), "t")
    mgr.cache_computed("a", tokens, len(tokens), "t")
    assert len(mgr.take_events()) == 1
    for step in range(2 * BS - 2):  # decode one token at a time
        tokens.append(1000 + step)
        assert mgr.allocate_slots("a", len(tokens)) is not None
        mgr.cache_computed("a", tokens, len(tokens) - 1, "t")  # the newest token is not computed yet
    h = hash_prompt_blocks(tokens, BS, "t", MODEL)
    assert len(tokens) == 3 * BS and len(h) == 3
    assert mgr.take_events() == [BlockStored(h[1], h[0], BS)]  # block 2 is full but not computed
    mgr.cache_computed("a", tokens, len(tokens), "t")
    assert mgr.take_events() == [BlockStored(h[2], h[1], BS)]
    assert [mgr.pool.block_hash(b) for b in mgr.block_table("a")] == h
    assert mgr.allocate_slots("a", len(tokens) + BS) == [3]
    with pytest.raises(RuntimeError, match="changed its cache salt"):
        mgr.cache_computed("a", tokens + [1] * BS, len(tokens) + BS, "other")
    free_all(mgr, "a")


def test_fork_shares_full_blocks_and_copies_partial(make_manager):
    mgr = make_manager(8)
    prompt = toks(0, 2 * BS + 2)
    prefill(mgr, "p", prompt)  # [0, 1, 2]; 0, 1 cached
    assert mgr.fork("p", "c1", len(prompt)) == (2, 3)
    assert mgr.block_table("c1") == [0, 1, 3]
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert mgr.fork("p", "c2", 2 * BS) is None
    assert mgr.block_table("c2") == [0, 1]
    assert refs(mgr, [0, 1, 2, 3]) == [3, 3, 1, 1]
    mgr.check_integrity()
    # The child's copy block is cached once it fills, unless the parent's twin got the hash first.
    c1 = prompt + [50, 51]
    mgr.cache_computed("c1", c1, len(c1), None)
    assert mgr.pool.block_hash(3) == hash_prompt_blocks(c1, BS, None, MODEL)[2]
    p = prompt + [50, 51]
    mgr.cache_computed("p", p, len(p), None)
    assert mgr.pool.block_hash(2) is None
    with pytest.raises(RuntimeError, match="already has a table"):
        mgr.fork("p", "c1", 1)
    with pytest.raises(RuntimeError, match="covers 12"):
        mgr.fork("p", "c3", 3 * BS + 1)
    mgr.free("p")
    assert refs(mgr, [0, 1, 2, 3]) == [2, 2, 0, 1]
    free_all(mgr, "c1", "c2")


def test_fork_without_free_block_raises_and_changes_nothing(make_manager):
    mgr = make_manager(2)
    mgr.allocate_slots("p", BS + 1)
    with pytest.raises(OutOfBlocksError, match="none is free"):
        mgr.fork("p", "c", BS + 1)
    assert not mgr.has("c") and refs(mgr, [0, 1]) == [1, 1]
    assert mgr.fork("p", "c", BS) is None  # full blocks only: needs no copy block
    assert refs(mgr, [0, 1]) == [2, 1]
    free_all(mgr, "p", "c")


def test_free_is_idempotent_and_reverse_ordered(make_manager):
    mgr = make_manager(8)
    mgr.allocate_slots("a", 3 * BS)
    mgr.free("a")
    assert not mgr.has("a")
    assert mgr.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    mgr.free("a")
    mgr.free("never-seen")
    assert mgr.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    free_all(mgr)


def test_waiting_sequence_releases_its_hits_and_finds_them_again(make_manager):
    mgr = make_manager(4)
    prompt = toks(0, 2 * BS + 1)
    prefill(mgr, "a", prompt)  # [0, 1, 2]; 0, 1 cached
    assert mgr.allocate_slots("a", 3 * BS + 1) == [3]  # the pool is now full
    mgr.take_events()
    assert mgr.get_computed_blocks("b", prompt, None) == 2 * BS
    assert refs(mgr, [0, 1]) == [2, 2]
    assert mgr.allocate_slots("b", len(prompt)) is None  # no room: "b" goes back to waiting
    assert mgr.block_table("b") == [0, 1]
    mgr.free("b")
    assert refs(mgr, [0, 1]) == [1, 1] and not mgr.has("b")
    mgr.free("a")
    assert mgr.pool.free_block_ids() == [3, 2, 1, 0]
    assert mgr.get_computed_blocks("b", prompt, None) == 2 * BS  # retry: still cached
    assert mgr.allocate_slots("b", len(prompt)) == [3]
    assert mgr.take_events() == []
    free_all(mgr, "b")


def test_caching_disabled(make_manager):
    mgr = make_manager(8, enable_prefix_caching=False)
    prompt = toks(0, 2 * BS + 1)
    assert prefill(mgr, "a", prompt) == 0
    assert prefill(mgr, "b", prompt) == 0
    assert mgr.block_table("b") == [3, 4, 5]
    assert mgr.take_events() == [] and mgr.pool.num_cached_blocks == 0
    free_all(mgr, "a", "b")


def test_check_integrity_catches_tampered_refcount(make_manager):
    mgr = make_manager(8)
    prefill(mgr, "a", toks(0, 2 * BS + 1))
    mgr.pool._ref[1] += 1  # a holder no table accounts for
    expected = r"1 blocks whose refcount differs.*block 1: refcount 2, held by 1"
    with pytest.raises(RuntimeError, match=expected):
        mgr.check_integrity()
    mgr.pool._ref[1] -= 1
    mgr._seqs["a"].table.append(0)  # a table holding a block twice
    with pytest.raises(RuntimeError, match="holds a block twice"):
        mgr.check_integrity()
    mgr._seqs["a"].table.pop()
    free_all(mgr, "a")


def test_known_block_hashes_are_trusted(make_manager):
    mgr = make_manager(16)
    prompt = toks(0, 3 * BS + 1)
    prefill(mgr, "a", prompt, salt="t")
    known = hash_prompt_blocks(prompt, BS, "t", MODEL)
    assert mgr.get_computed_blocks("b", prompt, "t", block_hashes=known) == 3 * BS
    assert mgr.block_table("b") == [0, 1, 2]
    # Trusted, not recomputed: a wrong second hash ends the hit there.
    assert mgr.get_computed_blocks("c", prompt, "t", block_hashes=known[:1] + [5]) == BS
    assert mgr.block_table("c") == [0]
    # Hashes for the blocks past the ones given are computed as usual.
    assert mgr.get_computed_blocks("d", prompt, "t", block_hashes=known[:1]) == 3 * BS
    free_all(mgr, "a", "b", "c", "d")


def test_release_leading_hands_back_old_blocks_and_keeps_positions(make_manager):
    mgr = make_manager(num_blocks=8)
    tokens = toks(0, 4 * BS + 1)
    prefill(mgr, "a", tokens)
    table = list(mgr.block_table("a"))
    assert mgr.num_free_blocks == 8 - 5
    assert mgr.release_leading("a", 3) == 3
    assert mgr.num_free_blocks == 8 - 2
    # The released entries repeat the first held block: positions and table length are unchanged.
    assert mgr.block_table("a") == [table[3]] * 3 + table[3:]
    assert mgr.release_leading("a", 2) == 0  # idempotent: nothing more behind
    assert mgr.release_leading("a", 99) == 1  # the last block always stays held
    assert mgr.block_table("a") == [table[4]] * 5
    mgr.check_integrity()
    mgr.free("a")
    assert mgr.num_free_blocks == 8


def test_released_blocks_stay_cached_for_other_prompts(make_manager):
    mgr = make_manager(num_blocks=8)
    tokens = toks(0, 3 * BS + 1)
    prefill(mgr, "a", tokens)
    first = mgr.block_table("a")[0]
    mgr.release_leading("a", 2)
    # Another prompt with the same start hits the released (cached, free) blocks.
    assert mgr.get_computed_blocks("b", tokens[: 2 * BS] + [99], None) == 2 * BS
    assert mgr.block_table("b")[0] == first
    mgr.check_integrity()


def test_only_registered_blocks_are_released_with_caching(make_manager):
    mgr = make_manager(num_blocks=8)
    tokens = toks(0, 3 * BS)
    mgr.get_computed_blocks("a", tokens, None)
    mgr.allocate_slots("a", len(tokens))
    mgr.cache_computed("a", tokens, BS, None)  # only the first block is computed and registered
    assert mgr.release_leading("a", 2) == 1
    plain = make_manager(num_blocks=8, enable_prefix_caching=False)
    plain.allocate_slots("a", len(tokens))
    assert plain.release_leading("a", 2) == 2


def test_fork_of_a_released_parent_shares_only_held_blocks(make_manager):
    mgr = make_manager(num_blocks=10)
    tokens = toks(0, 4 * BS + 2)
    prefill(mgr, "p", tokens)
    mgr.release_leading("p", 2)
    src_dst = mgr.fork("p", "c", len(tokens))
    assert src_dst is not None
    child = mgr.block_table("c")
    assert child[:2] == [child[2]] * 2 and child[2:4] == mgr.block_table("p")[2:4] and child[4] == src_dst[1]
    mgr.check_integrity()
    mgr.free("p")
    mgr.free("c")
    assert mgr.num_free_blocks == 10
