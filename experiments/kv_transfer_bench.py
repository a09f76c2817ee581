#!/usr/bin/env python3
"""KV transfer throughput over zmq (shm, ipc, tcp; plain or CURVE), as a ratio to an in-process memcpy.

Two processes: this one sends (ZmqKVSender), a spawned child receives (ZmqKVReceiver) into its own
cache and notes each completion time (CLOCK_MONOTONIC, shared by processes on Linux) in a list, which it
hands over once all the transfers of a size are in (a queue message per transfer would cost the
receiving process a thread switch each time, inside the measurement). Throughput of one size = reps * bytes / (last completion - first send start),
after `WARM_UP` transfers, with the same pages re-sent back to back. The time therefore includes
the sender's gather (index_select), the socket, and the receiver's scatter into scattered
destination blocks; it does not include a control-plane ack.

Transports: `shm` is an ipc receiver offering shared memory: the sender gathers the pages into a
shared-memory span and the socket carries only a note (what workers on one host do by default); `ipc`
is the same socket with shared memory off on both ends (the pages travel as frames); `tcp` as across
hosts. Measured one after the other in one run, each beside the memcpy baseline of the same moment.

Baseline: `dst.copy_(src)` of one contiguous tensor of the same size into a preallocated one, in this
process, best of several runs. Every process runs torch with one thread, so the ratio compares one
core's copy with a pipeline of two processes. That copy is of memory the CPU's caches may hold (up to
16 MiB here), while a transfer reads scattered blocks of a cache larger than them; so each size is also
measured beside `gather` (one copy of the transfer's own pages into this process's memory, best of
several runs: what any transport must do at least once), and `alone ms` is one transfer by itself, from
the send's start to the receiver's completion (median of 5): the time a handoff waits for its pages. With `--encryption none curve` each size is measured
both ways, one after the other in the same run, and `curve_over_none` is their throughput ratio (what
`transfer.encryption: curve` costs on that link).

    python experiments/kv_transfer_bench.py [--sizes-mib 1 4 16 64] [--transports shm ipc tcp]
                                            [--encryption none curve] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import random
import statistics
import time

import torch

from experiments.smoke import shrink
from kv_transfer.curve import CurveKeys
from kv_transfer.page_copy import gather_transfer_into
from kv_transfer.page_format import PageSpec, TransferHeader
from kv_transfer.zmq_transport import ZmqKVReceiver, ZmqKVSender

# A Llama-3-8B-like layout per layer slice: 8 KV heads x 128 dims, 16-token blocks, bfloat16.
LAYOUT = dict(block_size=16, num_kv_heads=8, head_dim=128)
NUM_LAYERS = 8
DTYPE = torch.bfloat16
# Transfers sent back to back before each size is timed: enough for every span of a shared-memory lane
# that the timed ones use to be touched once (a lane lives as long as its sender; its first touch is not
# what a long-lived worker pays per transfer).
WARM_UP = 4
BLOCK_MIB = 2 * NUM_LAYERS * 16 * 8 * 128 * 2 / 2**20  # one block, all layers, K and V: 0.5 MiB


def make_caches(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, LAYOUT["block_size"], LAYOUT["num_kv_heads"], LAYOUT["head_dim"])
    return [(torch.randn(shape).to(DTYPE), torch.randn(shape).to(DTYPE)) for _ in range(NUM_LAYERS)]


def _receiver_main(transport: str, num_blocks: int, keys: CurveKeys | None, endpoint_q, ask_q, done_q) -> None:
    torch.set_num_threads(1)
    done: list = []  # completion times, or a refusal's repr, appended by the receiving thread
    rx = ZmqKVReceiver(make_caches(num_blocks), lambda h: done.append(time.monotonic()),
                       lambda h, e: done.append(repr(e)), transport="ipc" if transport == "shm" else transport,
                       keys=keys, shm=transport == "shm")
    rx.start()
    endpoint_q.put(rx.endpoint)
    while (n := ask_q.get(timeout=600)) is not None:  # the next n outcomes, once they are all in
        deadline = time.monotonic() + 60
        while len(done) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        done_q.put(done[:n])
        del done[:n]
    rx.close()


def memcpy_gbps(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def gather_gbps(caches, src_ids: list[int], nbytes: int, reps: int) -> float:
    """One copy of the transfer's own pages (scattered blocks of a cache larger than the CPU's caches)
    into a buffer of this process, best of `reps`: what any transport must at least do once."""
    out = torch.zeros(nbytes, dtype=torch.uint8)
    ids = torch.tensor(src_ids)
    gather_transfer_into(caches, ids, out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        gather_transfer_into(caches, ids, out)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_transport(transport: str, sizes_mib: list[int], min_bytes: int, encryption: str) -> list[dict]:
    num_blocks = int(max(sizes_mib) / BLOCK_MIB) * 2 + 8
    caches = make_caches(num_blocks)
    keys = CurveKeys.generate() if encryption == "curve" else None
    ctx = mp.get_context("spawn")
    endpoint_q, ask_q, done_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(transport, num_blocks, keys, endpoint_q, ask_q, done_q), daemon=True)
    proc.start()
    rows = []
    sender = ZmqKVSender(keys=keys, shm=transport == "shm")
    try:
        endpoint = endpoint_q.get(timeout=60)
        rng = random.Random(0)
        for mib in sizes_mib:
            n = int(mib / BLOCK_MIB)
            src_ids, dest_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
            header = TransferHeader(f"{mib}MiB", "bench", PageSpec.from_caches(caches), tuple(dest_ids))
            nbytes = header.spec.transfer_nbytes(n)
            reps = max(5, min_bytes // nbytes)
            for _ in range(WARM_UP):
                sender.send(endpoint, header, caches, src_ids, timeout_s=60)
            _completions(ask_q, done_q, WARM_UP)
            t0 = time.monotonic()
            for _ in range(reps):
                sender.send(endpoint, header, caches, src_ids, timeout_s=60)
            t_end = max(_completions(ask_q, done_q, reps))
            if (transport == "shm") != bool(sender.shm_endpoints):
                raise RuntimeError(f"{transport}: the pages did not take the path being measured")
            gbps = reps * nbytes / (t_end - t0) / 1e9
            alone = []
            for _ in range(5):
                t0 = time.monotonic()
                sender.send(endpoint, header, caches, src_ids, timeout_s=60)
                alone.append(_completions(ask_q, done_q, 1)[0] - t0)
            base = memcpy_gbps(nbytes, reps=10)
            one_copy = gather_gbps(caches, src_ids, nbytes, reps=10)
            rows.append(dict(transport=transport, encryption=encryption, size_mib=mib, bytes=nbytes, reps=reps, gb_per_s=round(gbps, 3),
                             memcpy_gb_per_s=round(base, 3), ratio_to_memcpy=round(gbps / base, 3),
                             gather_gb_per_s=round(one_copy, 3), ratio_to_gather=round(gbps / one_copy, 3),
                             alone_ms=round(1e3 * statistics.median(alone), 2)))
    finally:
        sender.close()
        ask_q.put(None)
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
    return rows


def _completions(ask_q, done_q, n: int) -> list[float]:
    """The completion times of the next `n` transfers."""
    ask_q.put(n)
    got = done_q.get(timeout=90)
    refused = [g for g in got if isinstance(g, str)]
    if refused or len(got) < n:
        raise RuntimeError(f"receiver took {len(got) - len(refused)} of {n} benchmark transfers: {refused[:1]}")
    return got


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--transports", nargs="+", choices=["shm", "ipc", "tcp"], default=["shm", "ipc", "tcp"])
    ap.add_argument("--encryption", nargs="+", choices=["none", "curve"], default=["none"],
                    help="measure plain sockets, CURVE ones, or both (then their ratio too)")
    ap.add_argument("--min-mib-per-size", type=int, default=256, help="bytes sent per size (at least 5 transfers)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    shrink(args, {"sizes_mib": [1], "min_mib_per_size": 4})  # smoke mode (TANDEM_SMOKE=1): one small size
    torch.set_num_threads(1)
    rows = [r for t in args.transports for e in args.encryption
            for r in run_transport(t, args.sizes_mib, args.min_mib_per_size << 20, e)]
    _add_curve_ratio(rows)
    if args.json:
        print(json.dumps({"layout": {**LAYOUT, "num_layers": NUM_LAYERS, "dtype": str(DTYPE)},
                          "processes": "sender and receiver in two processes", "torch_threads": 1,
                          "machine": platform.platform(), "results": rows}, indent=2))
        return
    print(f"KV transfer, sender and receiver in two processes; {NUM_LAYERS} layers x {LAYOUT}, {DTYPE}")
    print(f"{'transport':>9} {'crypto':>6} {'MiB':>5} {'reps':>5} {'GB/s':>8} {'memcpy GB/s':>12} {'ratio':>7} "
          f"{'gather GB/s':>12} {'ratio':>7} {'alone ms':>9} {'curve/none':>10}")
    for r in rows:
        cost = f"{r['curve_over_none']:>10.3f}" if "curve_over_none" in r else f"{'':>10}"
        print(f"{r['transport']:>9} {r['encryption']:>6} {r['size_mib']:>5} {r['reps']:>5} {r['gb_per_s']:>8.2f} "
              f"{r['memcpy_gb_per_s']:>12.2f} {r['ratio_to_memcpy']:>7.3f} {r['gather_gb_per_s']:>12.2f} "
              f"{r['ratio_to_gather']:>7.3f} {r['alone_ms']:>9.2f} {cost}")


def _add_curve_ratio(rows: list[dict]) -> None:
    """On each CURVE row: its throughput over the plain one of the same transport and size."""
    plain = {(r["transport"], r["size_mib"]): r["gb_per_s"] for r in rows if r["encryption"] == "none"}
    for r in rows:
        base = plain.get((r["transport"], r["size_mib"]))
        if r["encryption"] == "curve" and base:
            r["curve_over_none"] = round(r["gb_per_s"] / base, 3)


if __name__ == "__main__":
    main()
