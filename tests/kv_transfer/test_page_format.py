import msgpack
import pytest
import torch

from kv_transfer.page_format import (
    HEADER_VERSION,
    PageFormatError,
    PageSpec,
    TransferError,
    TransferHeader,
    decode_header,
    encode_header,
)
from tests.kv_transfer import header_for, make_caches


def test_spec_from_caches():
    spec = PageSpec.from_caches(make_caches(torch.bfloat16, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8))
    assert spec == PageSpec("bfloat16", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    assert spec.page_nbytes == 4 * 2 * 8 * 2
    assert spec.transfer_nbytes(5) == 2 * 3 * 5 * spec.page_nbytes


@pytest.mark.parametrize("bad, words", [
    ([], "empty"),
    ([(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 9))], "differs from layer 0"),
    ([(torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8))] + [(torch.zeros(4, 4, 2, 8).half(),) * 2], "layer 1"),
    ([(torch.zeros(4, 4, 16),) * 2], "4-D"),
    ([(torch.zeros(4, 8, 2, 4).transpose(1, 3),) * 2], "contiguous"),
])
def test_spec_from_bad_caches(bad, words):
    with pytest.raises(PageFormatError, match=words):
        PageSpec.from_caches(bad)


def test_check_compatible_names_every_mismatch():
    sender = PageSpec("bfloat16", block_size=16, num_layers=2, num_kv_heads=4, head_dim=64)
    receiver = PageSpec("float32", block_size=16, num_layers=2, num_kv_heads=4, head_dim=128)
    sender.check_compatible(sender)
    with pytest.raises(PageFormatError) as e:
        sender.check_compatible(receiver)
    assert str(e.value) == ("page format mismatch: sender dtype=bfloat16, receiver dtype=float32; "
                            "sender head_dim=64, receiver head_dim=128")
    assert isinstance(e.value, ValueError)
    assert issubclass(TransferError, RuntimeError)


def test_spec_rejects_bad_fields():
    with pytest.raises(PageFormatError, match="unknown dtype 'float33'"):
        PageSpec("float33", 16, 2, 4, 64)
    with pytest.raises(PageFormatError, match="block_size must be a positive int"):
        PageSpec("float32", 0, 2, 4, 64)
    with pytest.raises(PageFormatError, match="head_dim must be a positive int"):
        PageSpec("float32", 16, 2, 4, True)


def test_header_round_trip():
    header = header_for(make_caches(), [7, 2, 12], "req-1", note=b"\x93\x05\x06\x07 the caller's own bytes")
    data = encode_header(header)
    assert isinstance(data, bytes)
    back = decode_header(data)
    assert back == header
    assert back.dest_block_ids == (7, 2, 12)
    assert back.note == b"\x93\x05\x06\x07 the caller's own bytes"
    assert decode_header(memoryview(data)) == header


def test_header_normalizes_and_validates():
    spec = PageSpec.from_caches(make_caches())
    assert TransferHeader("t", "l", spec, [3, 1]).dest_block_ids == (3, 1)
    for dest, words in [((), "non-empty"), ((1, -2), "non-negative"), ((1, True), "non-negative"),
                        ((1.0,), "non-negative")]:
        with pytest.raises(PageFormatError, match=words):
            TransferHeader("t", "l", spec, dest)
    with pytest.raises(PageFormatError, match="transfer_id must be a str"):
        TransferHeader(7, "l", spec, (1,))
    with pytest.raises(PageFormatError, match="note must be bytes, got dict"):
        TransferHeader("t", "l", spec, (1,), {1: "x"})


def _good_message() -> dict:
    return msgpack.unpackb(encode_header(header_for(make_caches(), [1, 2])))


@pytest.mark.parametrize("data, words", [
    (b"\xc1junk", "not msgpack"),
    (b"", "not msgpack"),
    (msgpack.packb([1, 2]), "expected a map"),
    (msgpack.packb({**_good_message(), "v": HEADER_VERSION + 1}), "unsupported transfer header version 4"),
    (msgpack.packb({k: v for k, v in _good_message().items() if k != "lease_id"}), "keys"),
    (msgpack.packb({**_good_message(), "spec": ["float32", 4, 2]}), "spec"),
    (msgpack.packb({**_good_message(), "spec": ["float99", 4, 2, 2, 8]}), "unknown dtype 'float99'"),
    (msgpack.packb({**_good_message(), "dest_block_ids": "12"}), "dest_block_ids"),
    (msgpack.packb({**_good_message(), "transfer_id": 5}), "transfer_id must be a str"),
    (msgpack.packb({**_good_message(), "heads": [1]}), "is not \\[first_head, total_kv_heads\\]"),
    (msgpack.packb({**_good_message(), "heads": [1, 2]}), "do not lie in the model's 2 KV heads"),
    (msgpack.packb({**_good_message(), "heads": [0, "2"]}), "total must be a positive int"),
])
def test_decode_rejects_malformed(data, words):
    with pytest.raises(PageFormatError, match=words):
        decode_header(data)
