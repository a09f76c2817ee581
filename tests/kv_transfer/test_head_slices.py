"""Head slices over real zmq sockets: a tensor-parallel rank sends (or receives) only some of the
model's KV heads, and each byte lands in the right heads of the right blocks."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.page_format import HeadSlice, PageFormatError, PageSpec, TransferHeader
from tests.kv_transfer import bit_equal, clone_caches, make_caches


def _slice_header(caches, first: int, count: int, total: int, dest, transfer_id="t") -> TransferHeader:
    spec = PageSpec.from_caches(caches)
    spec = PageSpec(spec.dtype, spec.block_size, spec.num_layers, count, spec.head_dim)
    return TransferHeader(transfer_id, "lease", spec, tuple(dest), b"", HeadSlice(first, count, total))


def _expected(before, src, src_heads: HeadSlice, dst_heads: HeadSlice, sent: HeadSlice, src_ids, dest_ids):
    out = clone_caches(before)
    a, b = sent.first - src_heads.first, sent.first - dst_heads.first
    for (k, v), (sk, sv) in zip(out, src):
        for s, d in zip(src_ids, dest_ids):
            k[d, :, b:b + sent.count] = sk[s, :, a:a + sent.count]
            v[d, :, b:b + sent.count] = sv[s, :, a:a + sent.count]
    return out


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_senders_fill_one_receiver(make_receiver, sender, dtype, staged):
    """P TP=2 -> D TP=1: each prefill rank holds 2 of 4 heads and sends exactly those; together they fill
    the whole block, and each transfer carries half the bytes."""
    whole = HeadSlice.whole(4)
    recv = make_receiver(make_caches(dtype, num_kv_heads=4, seed=9), staged=staged, heads=whole)
    before = clone_caches(recv.caches)
    ranks = [make_caches(dtype, num_kv_heads=2, seed=r) for r in range(2)]
    expected = before
    for r, caches in enumerate(ranks):
        mine = HeadSlice(2 * r, 2, 4)
        header = _slice_header(caches, 2 * r, 2, 4, [7, 3], f"r{r}")
        sender.send(recv.rx.endpoint, header, caches, [1, 5], 5.0, cache_heads=mine)
        assert recv.next_event() == ("ok", header)
        expected = _expected(expected, caches, mine, whole, mine, [1, 5], [7, 3])
    assert bit_equal(recv.caches, expected)
    page = 4 * 2 * 8 * dtype.itemsize  # block_size x heads x head_dim
    assert recv.rx.stats().bytes_received == 2 * (2 * 2 * 2 * page)  # 2 transfers x K,V x 2 layers x 2 blocks


def test_one_sender_splits_for_two_receivers(make_receiver, sender):
    """P TP=1 -> D TP=2: the sender cuts each block by heads; each receiver gets only its own."""
    src = make_caches(num_kv_heads=4, seed=1)
    whole = HeadSlice.whole(4)
    for r in range(2):
        mine = HeadSlice(2 * r, 2, 4)
        recv = make_receiver(make_caches(num_kv_heads=2, seed=10 + r), heads=mine)
        before = clone_caches(recv.caches)
        header = _slice_header(src, 2 * r, 2, 4, [0, 6])
        sender.send(recv.rx.endpoint, header, src, [2, 3], 5.0, cache_heads=whole)
        assert recv.next_event() == ("ok", header)
        assert bit_equal(recv.caches, _expected(before, src, whole, mine, mine, [2, 3], [0, 6]))
        assert recv.rx.stats().bytes_received == 2 * 2 * 2 * (4 * 2 * 8 * 4)


def test_replicated_head_lands_in_a_wider_receiver(make_receiver, sender):
    """A rank of a TP=4 group over 2 KV heads holds one head; it lands inside a receiver holding both."""
    recv = make_receiver(make_caches(num_kv_heads=2, seed=3), heads=HeadSlice.whole(2))
    before = clone_caches(recv.caches)
    src = make_caches(num_kv_heads=1, seed=4)
    header = _slice_header(src, 1, 1, 2, [9])
    sender.send(recv.rx.endpoint, header, src, [0], 5.0, cache_heads=HeadSlice(1, 1, 2))
    assert recv.next_event() == ("ok", header)
    assert bit_equal(recv.caches, _expected(before, src, HeadSlice(1, 1, 2), HeadSlice.whole(2), HeadSlice(1, 1, 2),
                                            [0], [9]))


@pytest.mark.parametrize("sent, words", [
    (HeadSlice(0, 2, 4), "sender sends heads [0, 2) of 4, receiver holds heads [2, 4) of 4"),
    (HeadSlice(1, 2, 4), "sender sends heads [1, 3) of 4, receiver holds heads [2, 4) of 4"),
    (HeadSlice(2, 2, 6), "sender sends heads [2, 4) of 6, receiver holds heads [2, 4) of 4"),
])
def test_heads_outside_the_receiver_are_refused(make_receiver, sender, sent, words):
    recv = make_receiver(make_caches(num_kv_heads=2, seed=3), heads=HeadSlice(2, 2, 4))
    before = clone_caches(recv.caches)
    src = make_caches(num_kv_heads=sent.total, seed=4)
    header = _slice_header(src, sent.first, 2, sent.total, [1])
    sender.send(recv.rx.endpoint, header, src, [0], 5.0, cache_heads=HeadSlice.whole(sent.total))
    kind, got, exc = recv.next_event()
    assert (kind, got) == ("error", header) and isinstance(exc, PageFormatError) and words in str(exc)
    assert bit_equal(recv.caches, before)


def test_sender_refuses_heads_it_does_not_hold(sender):
    caches = make_caches(num_kv_heads=2)
    with pytest.raises(PageFormatError, match="does not describe the caches being sent"):
        sender.send("ipc:///nonexistent", _slice_header(caches, 0, 2, 4, [1]), caches, [0], 1.0,
                    cache_heads=HeadSlice(2, 2, 4))
    with pytest.raises(PageFormatError, match="do not lie in the model's 4 KV heads"):
        HeadSlice(3, 2, 4)
