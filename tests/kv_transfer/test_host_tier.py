"""The host KV tier's pool (kv_transfer/host_tier.py) on real shared memory: slots leased, written, stored
under their hash, pinned by readers, evicted least recently used first; layouts that differ are refused by
name; the bookkeeping holds after every step."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.host_tier import HostTierPool, TierBlock
from kv_transfer.page_format import PageFormatError, PageSpec
from kv_transfer.shm_segment import Segment

SPEC = PageSpec("float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)  # 1 KiB a slot


def _tokens(i: int) -> tuple[int, ...]:
    return (i, i + 1, i + 2, i + 3)


@pytest.fixture
def pool():
    pool = HostTierPool(4 * SPEC.transfer_nbytes(1) + 100)  # room for 4 slots
    yield pool
    pool.close()


def test_blocks_written_by_one_mapping_are_read_by_another_and_evicted_lru(pool):
    layout = pool.attach(SPEC, "w", "w-1")
    assert (layout.num_slots, layout.slot_bytes) == (4, 1024)
    writer, reader = Segment.open(layout.segment, keep_name=True), Segment.open(layout.segment, keep_name=True)
    slots = pool.lease("w", 4)
    assert sorted(slots) == [0, 1, 2, 3] and pool.check_integrity().leased == 4
    for n, slot in enumerate(slots):
        writer.data[slot * 1024:(slot + 1) * 1024] = n + 1
    assert pool.commit("w", [TierBlock(s, 100 + n, _tokens(n)) for n, s in enumerate(slots)]) == 4
    assert pool.check_integrity().bytes == 4 * 1024
    assert pool.pin("r", [100, 101, 107], [_tokens(0), _tokens(1), _tokens(7)]) == slots[:2]  # the leading run only
    assert all(bool((reader.data[s * 1024:(s + 1) * 1024] == n + 1).all()) for n, s in enumerate(slots[:2]))
    assert pool.pin("r", [102], [_tokens(9)]) == []  # the hash with other tokens: a miss
    stats = pool.check_integrity()
    assert (stats.hits, stats.misses, stats.pinned) == (2, 2, 2)
    # Full: a new lease evicts the least recently used unpinned block (102: 100 and 101 were pinned, then used).
    again = pool.lease("w", 1)
    assert again == [slots[2]] and pool.check_integrity().evictions == 1
    assert pool.pin("r", [102], [_tokens(2)]) == []
    pool.unpin("r", slots[:2], loaded=True)
    assert pool.check_integrity().loads == 2
    # A hash already stored keeps its copy; the duplicate's slot is free again.
    assert pool.commit("w", [TierBlock(again[0], 101, _tokens(1))]) == 0
    assert pool.check_integrity().leased == 0
    with pytest.raises(ValueError, match="does not lease"):
        pool.commit("w", [TierBlock(again[0], 300, _tokens(3))])
    writer.close()
    reader.close()


def test_pinned_blocks_are_never_evicted_and_a_gone_client_frees_its_leases(pool):
    pool.attach(SPEC, "w", "w")
    slots = pool.lease("a", 4)
    pool.commit("a", [TierBlock(s, n, _tokens(n)) for n, s in enumerate(slots)])
    assert pool.pin("r", [0, 1, 2, 3], [_tokens(n) for n in range(4)]) == slots
    assert pool.lease("b", 2) == []  # every block pinned: nothing to evict
    pool.unpin("r", slots[:2], loaded=False)
    assert sorted(pool.lease("b", 3)) == sorted(slots[:2])
    pool.forget("b")
    stats = pool.check_integrity()
    assert (stats.blocks, stats.leased, stats.evictions, stats.loads) == (2, 0, 2, 0)


def test_a_worker_attaching_as_a_new_process_gets_back_what_its_last_process_held(pool):
    """Ray restarted it: the dead process's leases and pins would otherwise stay for good."""
    pool.attach(SPEC, "w", "w-1")
    slots = pool.lease("w-1", 3)
    pool.commit("w-1", [TierBlock(slots[0], 5, _tokens(5))])
    assert pool.pin("w-1", [5], [_tokens(5)]) == slots[:1]
    pool.attach(SPEC, "w", "w-1")  # the same process again: nothing changes
    assert (pool.check_integrity().leased, pool.check_integrity().pinned) == (2, 1)
    pool.attach(SPEC, "w", "w-2")
    stats = pool.check_integrity()
    assert (stats.leased, stats.pinned, stats.blocks) == (0, 0, 1)
    with pytest.raises(ValueError, match="has not pinned"):
        pool.unpin("w-1", slots[:1], loaded=True)


def test_a_mismatched_layout_is_refused_naming_the_fields(pool):
    pool.attach(SPEC, "w", "w")
    other = PageSpec("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    with pytest.raises(PageFormatError, match="dtype=bfloat16.*dtype=float32.*num_layers=3.*num_layers=2"):
        pool.attach(other, "x", "x")
    pool.check_integrity()


def test_a_tier_smaller_than_one_block_says_so():
    pool = HostTierPool(1000)
    with pytest.raises(ValueError, match="host_bytes 1000 is less than one block"):
        pool.attach(SPEC, "w", "w")
    with pytest.raises(ValueError, match="must be positive"):
        HostTierPool(0)
