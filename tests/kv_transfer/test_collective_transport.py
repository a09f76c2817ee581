"""torch.distributed (gloo) transport: three real processes in one group.

Rank 1 receives; ranks 0 and 2 send, concurrently in phase 1. The scenario runs once per session
(spawning processes costs seconds); each test asserts on the facts it reported. Every wait in the
children and in the parent has a deadline, so a broken transport fails the tests instead of hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from kv_transfer.collective_transport import (
    MAGIC,
    CollectiveKVReceiver,
    CollectiveKVSender,
    init_collective,
    rank_endpoint,
)
from kv_transfer.page_format import TransferError
from tests.kv_transfer import apply_transfer, bit_equal, header_for, make_caches

WORLD = 3
PHASE_S = 20.0
DEAD_TIMEOUT_S = 1.0
# (transfer id, sender rank, sender cache kwargs, src ids, dest ids); bad ones target blocks 14, 15.
GOOD_P1 = [("a1", 0, dict(seed=10), [5, 1, 9], [7, 2, 12]), ("b1", 2, dict(seed=20), [3, 0], [4, 10]),
           ("a2", 0, dict(seed=10), [0], [0])]
BAD_P1 = [("bad-dtype", dict(seed=11, dtype=torch.bfloat16)), ("bad-head_dim", dict(seed=11, head_dim=16)),
          ("bad-block_size", dict(seed=11, block_size=8)), ("bad-num_layers", dict(seed=11, num_layers=3))]
GOOD_P2 = ("a3", dict(seed=12, dtype=torch.bfloat16), [2, 11], [9, 3])


def _events(q: queue.Queue, n: int) -> list:
    deadline = time.monotonic() + PHASE_S
    return [q.get(timeout=max(0.0, deadline - time.monotonic())) for _ in range(n)]


def _receiver(group, barrier) -> dict:
    out = {}
    q: queue.Queue = queue.Queue()
    on_ok, on_err = (lambda h: q.put((h.transfer_id, None))), (lambda h, e: q.put((h and h.transfer_id, repr(e))))
    caches = make_caches(seed=2)
    expected = caches
    for tid, _, kw, src_ids, dest_ids in GOOD_P1:
        expected = apply_transfer(expected, make_caches(**kw), src_ids, dest_ids)
    rx = CollectiveKVReceiver(caches, on_ok, on_err, group=group)
    rx.start()
    barrier.wait(PHASE_S)  # phase 1: concurrent senders, mismatches, a malformed header
    out["p1_events"] = _events(q, len(GOOD_P1) + len(BAD_P1) + 1)
    out["p1_cache_ok"] = bit_equal(caches, expected)
    out["p1_stats"] = rx.stats()
    start = time.monotonic()
    rx.close()
    out["close_s"] = time.monotonic() - start

    caches = make_caches(torch.bfloat16, seed=3)  # phase 2: a new receiver adopts the parked receive
    tid, kw, src_ids, dest_ids = GOOD_P2
    expected = apply_transfer(caches, make_caches(**kw), src_ids, dest_ids)
    rx = CollectiveKVReceiver(caches, on_ok, on_err, group=group)
    rx.start()
    barrier.wait(PHASE_S)
    out["p2_events"] = _events(q, 1)
    out["p2_cache_ok"] = bit_equal(caches, expected)
    rx.close()
    barrier.wait(PHASE_S)  # phase 3: rank 0 sends to this rank with no receiver running
    barrier.wait(PHASE_S)
    return out


def _sender(group, barrier) -> dict:
    out = {}
    tx = CollectiveKVSender(group)
    barrier.wait(PHASE_S)
    for tid, rank, kw, src_ids, dest_ids in GOOD_P1:
        if rank != group.rank:
            continue
        if tid == "a2":  # after the refused ones: the receiver must still be serving
            for bad_tid, bad_kw in BAD_P1:
                src = make_caches(**bad_kw)
                tx.send("rank:1", header_for(src, [14, 15], bad_tid), src, [1, 2], timeout_s=PHASE_S)
            _send_malformed(group)
        src = make_caches(**kw)
        tx.send(rank_endpoint(1), header_for(src, dest_ids, tid, note=b"\x01\x02"), src, src_ids, timeout_s=PHASE_S)
    barrier.wait(PHASE_S)
    if group.rank == 0:
        tid, kw, src_ids, dest_ids = GOOD_P2
        src = make_caches(**kw)
        tx.send("rank:1", header_for(src, dest_ids, tid), src, src_ids, timeout_s=PHASE_S)
    barrier.wait(PHASE_S)
    if group.rank == 0:
        src = make_caches()
        start = time.monotonic()
        try:
            tx.send("rank:1", header_for(src, [1], "dead"), src, [1], timeout_s=DEAD_TIMEOUT_S)
        except Exception as e:
            out["dead_error"] = e
        out["dead_s"] = time.monotonic() - start
    barrier.wait(PHASE_S)
    return out


def _send_malformed(group) -> None:
    """A preamble and payloads that are fine, around a header that is not msgpack."""
    body = torch.frombuffer(bytearray(b"\xc1junk"), dtype=torch.uint8)
    dist.send(torch.tensor([MAGIC, len(body), 4, 64]), 1, tag=0)
    dist.send(body, 1, tag=1)
    for _ in range(4):
        dist.send(torch.zeros(64, dtype=torch.uint8), 1, tag=1)


def _worker(rank: int, port: int, barrier, results) -> None:
    try:
        torch.set_num_threads(1)
        group = init_collective(f"tcp://127.0.0.1:{port}", rank, WORLD, backend="gloo", timeout_s=PHASE_S)
        out = (_receiver if rank == 1 else _sender)(group, barrier)
    except BaseException:
        out = {"crash": traceback.format_exc()}
    results.put((rank, out))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_run() -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(WORLD), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, barrier, results), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    deadline = time.monotonic() + 60.0
    try:
        while len(out) < WORLD:
            rank, res = results.get(timeout=max(0.1, deadline - time.monotonic()))
            out[rank] = res
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5)
    assert len(out) == WORLD, f"ranks {sorted(set(range(WORLD)) - set(out))} reported nothing within the deadline"
    crashes = {r: o["crash"] for r, o in out.items() if "crash" in o}
    assert not crashes, crashes
    return out


def test_float32_parity_with_concurrent_senders(gloo_run):
    events = gloo_run[1]["p1_events"]
    assert sorted(tid for tid, err in events if err is None) == ["a1", "a2", "b1"]
    assert gloo_run[1]["p1_cache_ok"]  # dest blocks bit-identical, every other block untouched
    order = [tid for tid, _ in events]
    assert all(order.index("a2") > i for i, (_, err) in enumerate(events) if err)  # served after the refusals


def test_mismatches_refused_naming_the_field(gloo_run):
    rx = gloo_run[1]
    errors = {tid: err for tid, err in rx["p1_events"] if err is not None}
    assert set(errors) == {"bad-dtype", "bad-head_dim", "bad-block_size", "bad-num_layers", None}
    assert "sender dtype=bfloat16, receiver dtype=float32" in errors["bad-dtype"]
    assert "sender head_dim=16, receiver head_dim=8" in errors["bad-head_dim"]
    assert "sender block_size=8, receiver block_size=4" in errors["bad-block_size"]
    assert "sender num_layers=3, receiver num_layers=2" in errors["bad-num_layers"]
    assert errors[None].startswith("PageFormatError('malformed transfer header: not msgpack")
    stats = rx["p1_stats"]
    assert (stats.transfers_ok, stats.transfers_refused) == (3, 5)
    assert stats.bytes_received == 2 * 2 * (3 + 2 + 1) * (4 * 2 * 8 * 4)


def test_bfloat16_parity_on_a_reopened_receiver(gloo_run):
    assert gloo_run[1]["p2_events"] == [("a3", None)]
    assert gloo_run[1]["p2_cache_ok"]


def test_close_is_prompt(gloo_run):
    assert gloo_run[1]["close_s"] < 5.0  # bounded by the poll interval: no hang


def test_send_without_receiver_times_out(gloo_run):
    a = gloo_run[0]
    assert isinstance(a["dead_error"], TransferError)
    assert "transfer dead to rank:1" in str(a["dead_error"])
    assert DEAD_TIMEOUT_S <= a["dead_s"] < DEAD_TIMEOUT_S + 5.0  # not before its deadline, and no hang
