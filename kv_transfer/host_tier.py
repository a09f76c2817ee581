"""The node's host KV tier: a bounded pool of KV blocks in one shared-memory segment, keyed by the salted
prefix block hashes the workers' prefix caches use, least recently used first out.

One `HostTierPool` per node, owned by the node's tier actor (actors/kv_tier/), so it outlives any worker.
It alone holds the slot bookkeeping: which slots are free, which a worker leased to write into, which hold
a stored block (its hash, its token ids, how many readers pin it). Workers map the segment and move the
bytes themselves (one copy each way); they only ever hold slot numbers.

A slot holds one block of every layer in wire order (each layer's K page, then its V page: `page_copy`),
`PageSpec.transfer_nbytes(1)` bytes. The first worker to attach fixes the layout; a worker whose caches
have another layout is refused, every differing field named (`PageFormatError`).

Who calls what (the tier actor forwards each call as is):
- `attach(spec, worker, client)`: a worker joins as `client` (one per process); returns where the segment
  is and its slot size. A worker that attaches again as another client (Ray restarted it) gets back what
  its earlier process held: that one's leases and pins go (`forget`).
- `lease(client, n)`: up to n slots for a worker to write evicted blocks into (LRU blocks are evicted to
  make room; pinned ones never). A leased slot belongs to its client until `commit` or `give_back`.
- `commit(client, blocks)`: leased slots now hold those blocks; a hash already stored keeps its copy and
  the slot goes back to the free list.
- `pin(client, hashes, token_ids)`: the leading run of blocks stored under those hashes AND those exact tokens
  (a hash collision is a miss); they are held until `unpin`, so no eviction reuses a slot being read.
- `unpin(client, slots, loaded)`: the reader is done; `loaded` counts them as loads into a worker.
- `forget(client)`: a worker left; its leased slots are free again, its pins dropped.
"""

from __future__ import annotations

import mmap
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kv_transfer.page_format import PageFormatError, PageSpec
from kv_transfer.shm_segment import Segment


@dataclass(frozen=True)
class TierLayout:
    """What a worker needs to read and write the tier's slots."""

    segment: str
    slot_bytes: int
    num_slots: int
    spec: PageSpec


@dataclass(frozen=True)
class TierBlock:
    """A block written into a leased slot: its prefix hash and its token ids (compared on every hit)."""

    slot: int
    block_hash: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class TierStats:
    capacity_bytes: int
    bytes: int  # stored blocks' bytes
    blocks: int
    leased: int
    pinned: int
    hits: int  # blocks found by `pin`
    misses: int  # blocks asked for and not found
    loads: int  # blocks a worker copied into its pool
    stores: int  # blocks committed (duplicates not counted)
    evictions: int
    clients: tuple[str, ...] = ()  # the clients holding leased or pinned slots, sorted


@dataclass
class _Entry:
    slot: int
    token_ids: tuple[int, ...]
    pins: int = 0


class HostTierPool:
    def __init__(self, host_bytes: int):
        if host_bytes <= 0:
            raise ValueError(f"kv_tier.host_bytes must be positive to run a tier, got {host_bytes}")
        self.host_bytes = host_bytes
        self.layout: TierLayout | None = None
        self._segment: Segment | None = None
        self._free: list[int] = []  # popped from the end: slots in rising order, so memory is committed in order
        self._leased: dict[str, set[int]] = {}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # hash -> entry; head = least recently used
        self._slot_hash: dict[int, int] = {}
        self._pins: dict[str, Counter[int]] = {}  # client -> slots it pinned (a slot twice: two lookups)
        self._clients: dict[str, str] = {}  # worker -> the client (process) it attached as last
        self._committed_end = 0
        self.hits = self.misses = self.loads = self.stores = self.evictions = 0

    def attach(self, spec: PageSpec, worker: str, client: str) -> TierLayout:
        layout = self._attach(spec)
        earlier = self._clients.get(worker)
        if earlier is not None and earlier != client:
            self.forget(earlier)
        self._clients[worker] = client
        return layout

    def _attach(self, spec: PageSpec) -> TierLayout:
        if self.layout is not None:
            try:
                spec.check_compatible(self.layout.spec)
            except PageFormatError as e:
                raise PageFormatError(f"host KV tier holds another page layout (sender = this worker, receiver = "
                                      f"the tier): {e}") from None
            return self.layout
        slot_bytes = spec.transfer_nbytes(1)
        num_slots = self.host_bytes // slot_bytes
        if num_slots == 0:
            raise ValueError(f"kv_tier.host_bytes {self.host_bytes} is less than one block of this model "
                             f"({slot_bytes} bytes)")
        capacity = -(-num_slots * slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._segment = Segment.create(capacity)
        self._free = list(range(num_slots - 1, -1, -1))
        self.layout = TierLayout(self._segment.name, slot_bytes, num_slots, spec)
        return self.layout

    # ---- writers ----

    def lease(self, client: str, n: int) -> list[int]:
        out = []
        while len(out) < n:
            if not self._free and not self._evict_one():
                break
            out.append(self._free.pop())
        if out:
            self._leased.setdefault(client, set()).update(out)
            end = (max(out) + 1) * self.layout.slot_bytes
            if end > self._committed_end:  # memory behind a slot before anyone writes it (never a SIGBUS)
                self._segment.commit(end)
                self._committed_end = end
        return out

    def _evict_one(self) -> bool:
        for block_hash, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[block_hash]
                del self._slot_hash[entry.slot]
                self._free.append(entry.slot)
                self.evictions += 1
                return True
        return False

    def commit(self, client: str, blocks: Sequence[TierBlock]) -> int:
        """Returns how many blocks were newly stored."""
        mine = self._leased.get(client, set())
        stored = 0
        for block in blocks:
            if block.slot not in mine:
                raise ValueError(f"client {client} committed slot {block.slot}, which it does not lease")
            mine.discard(block.slot)
            if len(block.token_ids) != self.layout.spec.block_size or block.block_hash in self._entries:
                self._free.append(block.slot)
                continue
            self._entries[block.block_hash] = _Entry(block.slot, tuple(block.token_ids))
            self._slot_hash[block.slot] = block.block_hash
            stored += 1
        self.stores += stored
        return stored

    def give_back(self, client: str, slots: Sequence[int]) -> None:
        mine = self._leased.get(client, set())
        for slot in slots:
            if slot in mine:
                mine.discard(slot)
                self._free.append(slot)

    def forget(self, client: str) -> None:
        self._free.extend(self._leased.pop(client, ()))
        for slot, n in self._pins.pop(client, Counter()).items():
            self._entries[self._slot_hash[slot]].pins -= n

    # ---- readers ----

    def pin(self, client: str, hashes: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[int]:
        slots = []
        for block_hash, tokens in zip(hashes, token_ids):
            entry = self._entries.get(block_hash)
            if entry is None or entry.token_ids != tuple(tokens):
                break
            entry.pins += 1
            self._entries.move_to_end(block_hash)
            slots.append(entry.slot)
        self._pins.setdefault(client, Counter()).update(slots)
        self.hits += len(slots)
        self.misses += len(hashes) - len(slots)
        return slots

    def unpin(self, client: str, slots: Sequence[int], loaded: bool) -> None:
        mine = self._pins.get(client, Counter())
        for slot in slots:
            if mine[slot] <= 0:
                raise ValueError(f"client {client} unpinned slot {slot}, which it has not pinned")
            mine[slot] -= 1
            self._entries[self._slot_hash[slot]].pins -= 1
        self._pins[client] = +mine  # (drops the zero counts)
        if loaded:
            self.loads += len(slots)

    # ---- views ----

    def stats(self) -> TierStats:
        slot_bytes = self.layout.slot_bytes if self.layout else 0
        holders = {c for c, slots in self._leased.items() if slots} | {c for c, pins in self._pins.items() if pins}
        return TierStats(self.host_bytes, len(self._entries) * slot_bytes, len(self._entries),
                         sum(map(len, self._leased.values())), sum(e.pins > 0 for e in self._entries.values()),
                         self.hits, self.misses, self.loads, self.stores, self.evictions, tuple(sorted(holders)))

    def check_integrity(self) -> TierStats:
        """Raises RuntimeError, with the counts, if the bookkeeping is inconsistent; returns the stats."""
        stats = self.stats()
        if self.layout is None:
            if self._entries or self._free or self._leased:
                raise RuntimeError("host KV tier integrity: slots in use before any worker attached")
            return stats
        n = self.layout.num_slots
        free, leased = self._free, [s for slots in self._leased.values() for s in slots]
        stored = [e.slot for e in self._entries.values()]
        every = free + leased + stored
        problems = []
        if len(every) != n or set(every) != set(range(n)):
            problems.append(f"free {len(free)} + leased {len(leased)} + stored {len(stored)} != {n} distinct slots")
        if self._slot_hash != {e.slot: h for h, e in self._entries.items()}:
            problems.append("the slot -> hash map disagrees with the stored entries")
        held = Counter()
        for pins in self._pins.values():
            held.update(pins)
        if any(e.pins != held[e.slot] for e in self._entries.values()):
            problems.append("an entry's pin count differs from its clients' pins")
        if stats.bytes > self.host_bytes:
            problems.append(f"{stats.bytes} bytes stored, over host_bytes {self.host_bytes}")
        if problems:
            raise RuntimeError("host KV tier integrity: " + "; ".join(problems))
        return stats

    def close(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None
