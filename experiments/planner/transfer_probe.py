"""Measure KV handoff bandwidth and latency with the real zmq transport, between two caches in this process.

A one-block transfer gives the fixed latency; a large one, the bandwidth beyond it. Each time runs from
`send` to the receiver's completion callback, so it includes the sender's gather and the receiver's
scatter into its cache, as a handoff does. Both ends share this process (and its cores), so across
processes on a 2-core machine expect the same order of magnitude, not the same number.
"""

from __future__ import annotations

import queue
import statistics
import time

import torch

from kv_transfer.page_format import PageSpec, TransferHeader
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender


def measure_transfer(kv_caches, max_blocks: int = 256, repeats: int = 5) -> tuple[float, float]:
    """(bytes_per_s, latency_s) for moving pages of these caches over zmq ipc."""
    num_blocks = kv_caches[0][0].shape[0]
    large = min(max_blocks, num_blocks // 2)
    if large < 2:
        raise ValueError(f"the KV cache has {num_blocks} blocks; measuring a transfer needs at least 4")
    dest_caches = [(torch.empty_like(k), torch.empty_like(v)) for k, v in kv_caches]
    done: queue.Queue = queue.Queue()
    rx = ZmqKVReceiver(dest_caches, lambda h: done.put(time.perf_counter()), lambda h, e: done.put(e), transport="ipc")
    rx.start()
    tx = ZmqKVSender()
    spec = PageSpec.from_caches(kv_caches)
    try:
        def one(n: int) -> float:
            header = TransferHeader(f"probe-{n}", "probe", spec, tuple(range(n, 2 * n)))
            start = time.perf_counter()
            tx.send(rx.endpoint, header, kv_caches, list(range(n)), timeout_s=30)
            end = done.get(timeout=30)
            if isinstance(end, Exception):
                raise RuntimeError(f"the probe transfer failed: {end}")
            return end - start

        one(1)  # connect and warm up
        latency = statistics.median(one(1) for _ in range(repeats))
        big = statistics.median(one(large) for _ in range(repeats))
    finally:
        tx.close()
        rx.close()
    nbytes = spec.transfer_nbytes(large)
    return nbytes / max(big - latency, 1e-9), latency
