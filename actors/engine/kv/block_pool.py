"""BlockPool: the sole owner of a worker's physical KV blocks.

It holds the refcount of every block, the free queue (LRU order, evicted from the head) and the
prefix-cache map from block hash to block id. Everyone else holds block ids only.

Callers: `KVCacheManager` (allocate, lookup, touch, free, cache_block) on the engine's step loop;
the worker actor drains `take_events()` each step and forwards them to the global router, which
keeps its prefix index from the hashes.

Block ids run 0 .. num_blocks-1 and every one is usable: no block is reserved. The free queue
starts in id order, so a fresh pool hands out 0, 1, 2, ...

A free block (refcount 0) is either plain or cached: a cached free block keeps its KV and its hash
until `allocate` reuses it (evicting it from the cache), so `num_free_blocks` counts both kinds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from actors.engine.kv.host_tier import EvictedBlock
from actors.protocol.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for an allocation; nothing was changed."""


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, *, enable_events: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.enable_caching = enable_caching
        self._enable_events = enable_events
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # block id -> None; head = least recently freed = next to be reused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []
        # Told of the cached blocks each `allocate` evicts, before the caller can overwrite them (a host tier).
        self.on_evict: Callable[[list[EvictedBlock]], None] | None = None

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: plain free blocks plus evictable cached ones."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self._num_blocks

    # ---- per-block views (read only) ---------------------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is cached under, or None if it is not in the prefix cache."""
        return self._hash[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be reused) first. For tests and debugging: O(n)."""
        return list(self._free)

    # ---- allocation --------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Pops `n` blocks from the free-queue head (least recently freed first), refcount 1 each.

        A popped block that was cached is evicted: its hash stops hitting and a `BlockRemoved`
        event is queued. Raises `OutOfBlocksError` (changing nothing) if fewer than `n` are free;
        callers check `num_free_blocks` first.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} blocks, only {len(self._free)} free of {self._num_blocks}")
        out, evicted = [], []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if self._hash[block_id] is not None:
                if self.on_evict is not None:
                    evicted.append(EvictedBlock(block_id, self._hash[block_id], self._tokens[block_id]))
                self._evict(block_id)
            self._ref[block_id] = 1
            out.append(block_id)
        if evicted:
            self.on_evict(evicted)
        return out

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash[block_id]
        del self._cached[block_hash]
        self._hash[block_id] = None
        self._tokens[block_id] = None
        if self._enable_events:
            self._events.append(BlockRemoved(block_hash))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds one holder to each block; a cached free block leaves the free queue (not evicted).

        Only blocks already held, or cached free blocks found by `lookup`, may be touched: a
        plain free block has no valid contents, and touching one raises RuntimeError.
        """
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                if self._hash[block_id] is None:
                    raise RuntimeError(f"touch of block {block_id}: it is free and not cached")
                del self._free[block_id]
            self._ref[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one holder from each block; blocks reaching 0 join the free-queue tail in order.

        The tail is reused last, so pass a sequence's blocks in REVERSE table order: its tail
        blocks (least likely to be shared as a prefix) are then evicted before its head blocks.
        Cached blocks keep their hash and KV until reused. Freeing a block with refcount 0
        raises RuntimeError (a double free), after the blocks before it were freed.
        """
        for block_id in block_ids:
            ref = self._ref[block_id]
            if ref <= 0:
                raise RuntimeError(f"free of block {block_id} with refcount {ref} (double free)")
            self._ref[block_id] = ref - 1
            if ref == 1:
                self._free[block_id] = None

    # ---- prefix cache ------------------------------------------------------------------------

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The cached block with this hash AND these exact token ids, or None.

        A hash hit whose tokens differ (a collision) is a miss. Changes nothing: the caller
        touches the block to hold it.
        """
        block_id = self._cached.get(block_hash)
        if block_id is None or self._tokens[block_id] != tuple(token_ids):
            return None
        return block_id

    def cache_block(
        self, block_id: int, block_hash: int, token_ids: Sequence[int], parent_hash: int | None = None
    ) -> bool:
        """Registers a held, full, computed block under `block_hash`; True if it was newly cached.

        Idempotent for a block already cached under the same hash. If another block already holds
        this hash, that one is kept and this block stays uncached (False). Queues a `BlockStored`
        event on success. No-op (False) when caching is disabled.
        """
        if not self.enable_caching:
            return False
        if self._ref[block_id] <= 0:
            raise RuntimeError(f"cache_block of block {block_id}, which is not held")
        if len(token_ids) != self._block_size:
            raise RuntimeError(
                f"cache_block of block {block_id} with {len(token_ids)} tokens, block size {self._block_size}"
            )
        current = self._hash[block_id]
        if current is not None:
            if current != block_hash:
                raise RuntimeError(f"block {block_id} is cached under {current:#x}, not {block_hash:#x}")
            return False
        if block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._hash[block_id] = block_hash
        self._tokens[block_id] = tuple(token_ids)
        if self._enable_events:
            self._events.append(BlockStored(block_hash, parent_hash, len(token_ids)))
        return True

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash if no block is in use (queues `AllCleared`); False otherwise."""
        if self.num_used_blocks:
            return False
        for block_id in self._cached.values():
            self._hash[block_id] = None
            self._tokens[block_id] = None
        self._cached.clear()
        if self._enable_events:
            self._events.append(AllCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        """Returns the queued events, oldest first, and empties the queue."""
        events, self._events = self._events, []
        return events

    # ---- checks ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raises RuntimeError, with the counts, if the bookkeeping is inconsistent."""
        n = self._num_blocks
        used = sum(1 for r in self._ref if r > 0)
        negative = [b for b, r in enumerate(self._ref) if r < 0]
        free = list(self._free)
        bad_free = [b for b in free if not 0 <= b < n or self._ref[b] != 0]
        problems = []
        if len(free) + used != n:
            problems.append(f"free {len(free)} + used {used} != total {n}")
        if negative:
            problems.append(f"{len(negative)} blocks with negative refcount, e.g. {negative[:5]}")
        if bad_free:
            problems.append(f"{len(bad_free)} free-queue blocks out of range or held, e.g. {bad_free[:5]}")
        wrong_map = [(h, b) for h, b in self._cached.items() if self._hash[b] != h or self._tokens[b] is None]
        if wrong_map:
            problems.append(f"{len(wrong_map)} hash-map entries point to blocks with another hash")
        hashed = sum(1 for h in self._hash if h is not None)
        if hashed != len(self._cached):
            problems.append(f"{hashed} blocks carry a hash but the hash map has {len(self._cached)} entries")
        if not self.enable_caching and self._cached:
            problems.append(f"caching is disabled but {len(self._cached)} blocks are cached")
        if problems:
            raise RuntimeError("BlockPool integrity: " + "; ".join(problems))
