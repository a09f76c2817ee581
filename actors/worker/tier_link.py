"""A worker's end of its node's host KV tier (actors/kv_tier/actor.py): the `HostTier` its engine's cache
manager calls (actors/engine/kv/host_tier.py), on the engine thread.

Writes go behind: the worker keeps a small stock of slots leased from the tier; a block its pool evicts is
copied at once (one copy, cache -> shared memory) into a stock slot, and this link's own thread tells the
tier which block each written slot holds and leases more. With the stock empty an evicted block is dropped
(counted): the engine never waits for the tier to write. A lookup that misses locally asks the tier for the
following blocks (one call), copies the hits from shared memory into fresh blocks and unpins them later.

If the tier cannot be reached (its actor died, a call timed out) the link goes quiet for good: offers are
dropped and lookups miss, so the worker serves on with its own prefix cache only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import ray
import torch

from actors.engine.kv.host_tier import EvictedBlock
from actors.kv_tier.actor import tier_name
from kv_transfer.host_tier import TierBlock
from kv_transfer.page_copy import gather_transfer_into, scatter_transfer
from kv_transfer.page_format import PageSpec
from kv_transfer.shm_segment import Segment

log = logging.getLogger("tandem.worker")
_CALL_TIMEOUT_S = 10.0  # a tier call that takes this long counts the tier as gone (a loaded box takes seconds)
_STOCK_SHARE = 4  # a worker's stock is at most this fraction of the tier (1/4): several workers share a node
_FLUSH_S = 0.05  # how often the link's thread publishes written slots and refills the stock


class TierLink:
    def __init__(self, actor, kv_caches, worker: str, client: str, stock: int):
        """`stock`: slots to hold for evictions, at most what one step can evict (its token budget in blocks);
        evictions beyond it before the link's thread refills it are dropped."""
        self._actor, self._caches, self.client = actor, kv_caches, client
        spec = PageSpec.from_caches(kv_caches)
        layout = ray.get(actor.attach.remote(spec, worker, client), timeout=_CALL_TIMEOUT_S)
        self._segment = Segment.open(layout.segment, keep_name=True)
        self._slot_bytes, self._pages = layout.slot_bytes, 2 * spec.num_layers
        self._max_stock = max(1, min(stock, layout.num_slots // _STOCK_SHARE))
        self._lock = threading.Lock()  # the stock and the queues: the engine thread and the link's thread
        self._stock: list[int] = []
        self._written: list[TierBlock] = []
        self._unpins: list[tuple[list[int], bool]] = []
        self._wake, self._stop = threading.Event(), threading.Event()
        self.alive = True
        self.dropped = self.loaded = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-tier-{client}", daemon=True)
        self._thread.start()

    def _slot(self, slot: int) -> torch.Tensor:
        return self._segment.data[slot * self._slot_bytes:(slot + 1) * self._slot_bytes]

    # ---- the engine thread (HostTier) ----

    def offer(self, evicted: Sequence[EvictedBlock]) -> None:
        for block in evicted:
            with self._lock:
                slot = self._stock.pop() if self._stock and self.alive else None
            if slot is None:
                self.dropped += 1
                continue
            gather_transfer_into(self._caches, torch.tensor([block.block_id]), self._slot(slot))
            with self._lock:
                self._written.append(TierBlock(slot, block.block_hash, block.token_ids))
        self._wake.set()

    def find(self, hashes: Sequence[int], token_ids: Sequence[Sequence[int]]) -> list[int]:
        if not self.alive or not hashes:
            return []
        try:
            return ray.get(self._actor.pin.remote(self.client, list(hashes), [tuple(t) for t in token_ids]),
                           timeout=_CALL_TIMEOUT_S)
        except Exception as exc:  # (a pin that lands after a timeout stays pinned: the tier counts it)
            self._lost(exc)
            return []

    def load(self, handles: Sequence[int], block_ids: Sequence[int]) -> None:
        for slot, block_id in zip(handles, block_ids):
            pages = self._slot(slot).view(self._pages, -1)
            scatter_transfer(self._caches, torch.tensor([block_id]), list(pages))
        self.loaded += len(handles)

    def done(self, handles: Sequence[int], loaded: bool) -> None:
        if handles:
            with self._lock:
                self._unpins.append((list(handles), loaded))
            self._wake.set()

    # ---- the link's thread ----

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._flush()
            except Exception as exc:
                self._lost(exc)
                return
            self._wake.wait(_FLUSH_S)
            self._wake.clear()

    def _flush(self) -> None:
        with self._lock:
            written, self._written = self._written, []
            unpins, self._unpins = self._unpins, []
            need = self._max_stock - len(self._stock)
        calls = [self._actor.unpin.remote(self.client, slots, loaded) for slots, loaded in unpins]
        if written:
            calls.append(self._actor.commit.remote(self.client, written))
        ray.get(calls, timeout=_CALL_TIMEOUT_S)
        if need > 0:
            slots = ray.get(self._actor.lease.remote(self.client, need), timeout=_CALL_TIMEOUT_S)
            with self._lock:
                self._stock.extend(slots)

    def _lost(self, exc: Exception) -> None:
        if self.alive:
            log.warning("worker %s: the node's KV tier is gone (%s: %s); serving on without it", self.client,
                        type(exc).__name__, exc)
        self.alive = False

    def close(self) -> None:
        """Stops the thread, hands the tier back every slot it leased (written or not), unmaps the segment."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=_CALL_TIMEOUT_S)
        if self.alive:
            try:
                ray.get(self._actor.forget.remote(self.client), timeout=_CALL_TIMEOUT_S)
            except Exception as exc:
                self._lost(exc)
        self.alive = False
        self._segment.close()


def attach_node_tier(namespace: str | None, worker: str, client: str, kv_caches, tensor_parallel: bool,
                     stock: int) -> TierLink | None:
    """The link to this node's tier, or None: no tier configured (`namespace` None), a tensor-parallel worker
    (a rank's caches hold only some heads), or a tier that is missing or refuses this worker's page layout
    (logged, naming what differs: the worker serves without a tier)."""
    if namespace is None:
        return None
    if tensor_parallel:
        log.warning("worker %s: tensor-parallel workers do not use the host KV tier yet", client)
        return None
    try:
        actor = ray.get_actor(tier_name(ray.get_runtime_context().get_node_id()), namespace=namespace)
        return TierLink(actor, kv_caches, worker, client, stock)
    except Exception as exc:
        log.warning("worker %s: no host KV tier (%s: %s)", client, type(exc).__name__, exc)
        return None
