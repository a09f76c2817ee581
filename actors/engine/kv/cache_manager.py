"""KVCacheManager: per-sequence block tables on top of one BlockPool.

The engine's batcher calls it each step, per sequence (`seq_id` is any hashable id):

1. new sequence: `get_computed_blocks` (prefix-cache hits become the start of its table),
2. before each forward pass: `allocate_slots` (all-or-nothing; None means "not now"),
3. after each forward pass: `cache_computed` (full, computed blocks enter the prefix cache),
4. n > 1 samples: `fork` (children share the parent's full blocks),
5. a model whose every layer has a sliding window: `release_leading` hands back the blocks no later
   query can attend to,
6. every terminal path: `free` (idempotent).

Block tables grow at the end and keep their positions: entry i always covers tokens i*bs .. (i+1)*bs-1.
Entries before `num_released` no longer hold a block; they repeat the first held block, so a gather over
the whole table stays in bounds and reads finite KV that the window masks discard. The pool stays the
only owner of refcounts; this class only records which blocks each table holds.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from actors.engine.kv.block_hash import extend_block_hashes, first_block_keys
from actors.engine.kv.block_pool import BlockPool, OutOfBlocksError
from actors.engine.kv.host_tier import HostTier
from actors.protocol.kv_events import KVEvent


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of the first full blocks, in order
    num_registered: int = 0  # table[:num_registered] went through cache_block (or were hits)
    first_keys: tuple | None = None  # extra keys of block 0; None until the salt is known
    num_released: int = 0  # leading entries handed back (release_leading): they hold no block

    @property
    def held(self) -> list[int]:
        return self.table[self.num_released :]


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, model_id: str = ""
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_caching=enable_prefix_caching)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self._seqs: dict[Hashable, _SeqBlocks] = {}
        self._tier: HostTier | None = None

    def attach_tier(self, tier: HostTier | None) -> None:
        """A second tier below the pool (host_tier.py): evicted blocks are offered to it, and a prefix that
        misses here is looked up there and loaded into fresh blocks. None detaches it."""
        self._tier = tier
        self.pool.on_evict = None if tier is None else tier.offer

    # ---- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table (the live list: read it, never mutate it)."""
        return self._seqs[seq_id].table

    def num_new_blocks_needed(self, seq_id: Hashable, num_total_tokens: int) -> int:
        """Blocks `allocate_slots(seq_id, num_total_tokens)` would take from the pool now."""
        seq = self._seqs.get(seq_id)
        have = len(seq.table) if seq else 0
        return max(0, -(-num_total_tokens // self.block_size) - have)

    # ---- lifecycle ---------------------------------------------------------------------------

    def get_computed_blocks(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        cache_salt: str | None,
        block_hashes: Sequence[int] = (),
        use_cache: bool = True,
    ) -> int:
        """Starts a new sequence's table with its longest cached prefix; returns the cached tokens.

        Only full blocks hit, and at least the last token is left to compute (its logits are
        needed), so the result is a multiple of block_size and < len(token_ids) (0 for an empty
        prompt or with caching disabled). Hit blocks are held (touched) until `free(seq_id)`; if
        the sequence then cannot get its slots and goes back to waiting, call `free(seq_id)`.
        `block_hashes`, if given, are the known hashes of the leading full blocks (e.g. from the
        router's `hash_prompt_blocks`); they are trusted, not recomputed. `use_cache=False`: no hits (a
        sequence that must compute every token, e.g. to score its prompt); its blocks are still cached
        once computed.
        """
        if seq_id in self._seqs:
            raise RuntimeError(f"get_computed_blocks for sequence {seq_id!r}, which already has a table")
        seq = _SeqBlocks(first_keys=first_block_keys(cache_salt, self.model_id))
        self._seqs[seq_id] = seq
        if not self.enable_prefix_caching or not token_ids or not use_cache:
            return 0
        seq.hashes.extend(block_hashes[: len(token_ids) // self.block_size])
        extend_block_hashes(seq.hashes, token_ids, self.block_size, seq.first_keys)
        max_hits = (len(token_ids) - 1) // self.block_size
        bs = self.block_size
        for i in range(max_hits):
            block_id = self.pool.lookup(seq.hashes[i], token_ids[i * bs : (i + 1) * bs])
            if block_id is None:
                break
            seq.table.append(block_id)
        self.pool.touch(seq.table)
        if self._tier is not None and len(seq.table) < max_hits:
            self._load_from_tier(seq, token_ids, max_hits)
        seq.num_registered = len(seq.table)
        return len(seq.table) * bs

    def _load_from_tier(self, seq: _SeqBlocks, token_ids: Sequence[int], max_hits: int) -> None:
        """Extends the table with the tier's run of the blocks after the local hits, loaded into fresh blocks
        and cached here (their `BlockStored` events tell the router)."""
        bs, start = self.block_size, len(seq.table)
        spans = [tuple(token_ids[i * bs:(i + 1) * bs]) for i in range(start, max_hits)]
        handles = self._tier.find(seq.hashes[start:max_hits], spans)
        use = handles[:self.pool.num_free_blocks]
        loaded = False
        try:
            if not use:
                return
            blocks = self.pool.allocate(len(use))
            try:
                self._tier.load(use, blocks)
            except Exception:  # the blocks hold nothing usable: back uncached, the prompt computes them
                self.pool.free(reversed(blocks))
                return
            loaded = True
            for j, block_id in enumerate(blocks):
                i = start + j
                if not self.pool.cache_block(block_id, seq.hashes[i], spans[j], seq.hashes[i - 1] if i else None):
                    self.pool.free(reversed(blocks[j:]))  # (a hash this pool caches with other tokens)
                    break
                seq.table.append(block_id)
        finally:
            self._tier.done(handles, loaded)

    def allocate_slots(self, seq_id: Hashable, num_total_tokens: int) -> list[int] | None:
        """Grows the table to cover `num_total_tokens` slots; returns the new block ids.

        All-or-nothing: None, with nothing changed, if the pool lacks free blocks. A sequence
        without a table (e.g. KV adopted from a prefill worker) gets one. Blocks held through
        `get_computed_blocks` already left the free queue, so they are not counted twice.
        """
        seq = self._seqs.get(seq_id)
        need = self.num_new_blocks_needed(seq_id, num_total_tokens)
        if need > self.pool.num_free_blocks:
            return None
        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks()
        new = self.pool.allocate(need)
        seq.table.extend(new)
        return new

    def cache_computed(
        self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int, cache_salt: str | None
    ) -> None:
        """Registers every block of the sequence that is full and computed in the prefix cache.

        `token_ids` are all the sequence's tokens so far (prompt + outputs). Idempotent and
        incremental: blocks registered before are skipped and their hashes are not recomputed.
        No-op with caching disabled.
        """
        if not self.enable_prefix_caching:
            return
        seq = self._seqs[seq_id]
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        num_full = min(num_full, len(seq.table))
        if num_full <= seq.num_registered:
            return
        keys = first_block_keys(cache_salt, self.model_id)
        if seq.first_keys is None:
            seq.first_keys = keys
        elif seq.first_keys != keys:
            raise RuntimeError(f"sequence {seq_id!r} changed its cache salt or model id")
        if len(seq.hashes) < num_full:
            extend_block_hashes(seq.hashes, token_ids, bs, keys, max_blocks=num_full)
        for i in range(seq.num_registered, num_full):
            parent = seq.hashes[i - 1] if i else None
            self.pool.cache_block(seq.table[i], seq.hashes[i], token_ids[i * bs : (i + 1) * bs], parent)
        seq.num_registered = num_full

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> tuple[int, int] | None:
        """Starts `child_id` as a copy of the parent's first `num_tokens` tokens.

        The child shares (one more holder on) each FULL block of those tokens. A partial last
        block gets a fresh block instead; the returned (src, dst) pair is the KV copy the caller
        must do before the child's next forward pass. None if there is no partial block.
        Raises `OutOfBlocksError`, changing nothing, if a copy block is needed and none is free.
        """
        if child_id in self._seqs:
            raise RuntimeError(f"fork into sequence {child_id!r}, which already has a table")
        parent = self._seqs[parent_id]
        bs = self.block_size
        if not 0 <= num_tokens <= len(parent.table) * bs:
            covered = len(parent.table) * bs
            raise RuntimeError(f"fork of {num_tokens} tokens; the parent's table covers {covered}")
        num_full, partial = divmod(num_tokens, bs)
        if partial and self.pool.num_free_blocks == 0:
            raise OutOfBlocksError(f"fork of {parent_id!r} needs one copy block and none is free")
        released = min(parent.num_released, num_full)
        if released and released == num_full and not partial:
            raise RuntimeError(f"fork of {num_tokens} tokens of {parent_id!r}: every one of their blocks was released")
        shared = parent.table[:num_full]
        self.pool.touch(shared[released:])
        child = _SeqBlocks(
            table=list(shared),
            hashes=parent.hashes[:num_full],
            num_registered=min(parent.num_registered, num_full),
            first_keys=parent.first_keys,
            num_released=released,
        )
        self._seqs[child_id] = child
        copy = None
        if partial:
            (dst,) = self.pool.allocate(1)
            child.table.append(dst)
            copy = parent.table[num_full], dst
        child.table[:released] = [child.table[released]] * released  # repeat a block the child holds
        return copy

    def release_leading(self, seq_id: Hashable, num_blocks: int) -> int:
        """Hands back the sequence's first `num_blocks` blocks (those no later query attends to); returns
        how many were released now.

        At least the last block stays held (the released entries repeat the first held one). With prefix
        caching only registered blocks go: they stay in the cache, evictable, for other prompts to hit.
        """
        seq = self._seqs[seq_id]
        limit = min(num_blocks, len(seq.table) - 1)
        if self.enable_prefix_caching:
            limit = min(limit, seq.num_registered)
        if limit <= seq.num_released:
            return 0
        released = seq.table[seq.num_released : limit]
        seq.table[:limit] = [seq.table[limit]] * limit
        seq.num_released = limit
        self.pool.free(reversed(released))
        return len(released)

    def free(self, seq_id: Hashable) -> None:
        """Releases the sequence's blocks, tail first (its head blocks stay cached longest).

        Idempotent: freeing an unknown or already freed sequence does nothing.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.held))

    def take_events(self) -> list[KVEvent]:
        """The pool's queued KV events (see BlockPool.take_events)."""
        return self.pool.take_events()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ---- checks ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pool integrity, plus: each block's refcount equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        problems = []
        for seq_id, seq in self._seqs.items():
            held = seq.held
            if len(set(held)) != len(held):
                problems.append(f"sequence {seq_id!r} holds a block twice")
            if seq.num_released and (not held or any(b != held[0] for b in seq.table[: seq.num_released])):
                problems.append(f"sequence {seq_id!r}: its {seq.num_released} released entries do not repeat a held block")
            for i, block_id in enumerate(held, start=seq.num_released):
                holders[block_id] += 1
                cached = self.pool.block_hash(block_id)
                if cached is not None and i < len(seq.hashes) and cached != seq.hashes[i]:
                    problems.append(f"sequence {seq_id!r} block {i} is cached under another hash")
            if seq.num_registered > len(seq.table):
                problems.append(
                    f"sequence {seq_id!r} registered {seq.num_registered} of {len(seq.table)} blocks"
                )
        wrong = [b for b in range(self.pool.num_blocks) if holders[b] != self.pool.ref_count(b)]
        if wrong:
            b = wrong[0]
            problems.append(
                f"{len(wrong)} blocks whose refcount differs from their holders, "
                f"e.g. block {b}: refcount {self.pool.ref_count(b)}, held by {holders[b]} tables"
            )
        if problems:
            header = f"KVCacheManager integrity ({len(self._seqs)} sequences): "
            raise RuntimeError(header + "; ".join(problems))
