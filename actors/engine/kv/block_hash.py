"""The one hash function for prefix blocks, shared by every worker's block pool and the global router.

A block hash covers a chain: hash(parent hash, token ids of one full block, extra keys). The first
block of a sequence carries the model id and the tenant's cache salt in its extra keys, so two
tenants (or two models) never produce the same hash for the same tokens, and every later block
inherits that separation through its parent hash.

Hashes are unsigned 64-bit ints (they fit msgpack's uint64 on the wire) computed with BLAKE2b over a
canonical byte encoding, so they are equal across processes, machines and Python versions. Never
use Python's built-in `hash()` here: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BITS = 64
_DIGEST_BYTES = HASH_BITS // 8
# Domain separation: bump the version if the encoding below ever changes.
_PERSON = b"tandem-block-v1"

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"
_U64 = struct.Struct("<Q")

_token_structs: dict[int, struct.Struct] = {}


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    n = len(token_ids)
    packer = _token_structs.get(n)
    if packer is None:
        # Length-prefixed, little-endian signed 64-bit ids: unambiguous and platform-independent.
        packer = _token_structs.setdefault(n, struct.Struct(f"<Q{n}q"))
    return packer.pack(n, *token_ids)


def _encode_key(key: object, out: bytearray) -> None:
    """Appends a tagged, length-prefixed encoding of one extra key (recursive for tuples)."""
    if key is None:
        out += b"N"
    elif isinstance(key, bool):  # before int: bool is an int subclass
        out += b"T" if key else b"F"
    elif isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        out += b"i" + _U64.pack(len(raw)) + raw
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out += b"s" + _U64.pack(len(raw)) + raw
    elif isinstance(key, bytes):
        out += b"b" + _U64.pack(len(key)) + key
    elif isinstance(key, tuple):
        out += b"t" + _U64.pack(len(key))
        for item in key:
            _encode_key(item, out)
    else:
        raise TypeError(
            f"block hash extra key {key!r} has type {type(key).__name__}; "
            "use None, bool, int, str, bytes or a tuple of those"
        )


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> int:
    """Hash of one block: its parent's hash (None for the first block), its token ids, extra keys.

    Deterministic across processes and machines. Returns an int in [0, 2**64).
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=_PERSON)
    if parent_hash is None:
        h.update(_NO_PARENT)
    else:
        h.update(_HAS_PARENT + _U64.pack(parent_hash))
    h.update(_pack_tokens(token_ids))
    keys = bytearray()
    _encode_key(tuple(extra_keys), keys)
    h.update(keys)
    return int.from_bytes(h.digest(), "little")


def first_block_keys(cache_salt: str | None, model_id: str) -> tuple:
    """Extra keys of a sequence's first block: the model id and the tenant's cache salt.

    `cache_salt=None` (no tenant isolation) and `cache_salt=""` are different keys.
    """
    return (("model", model_id), ("salt", cache_salt))


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    first_keys: tuple,
    max_blocks: int | None = None,
) -> int:
    """Appends, in place, the hashes of the full blocks of `token_ids` that `hashes` lacks.

    `hashes[i]` must already be the hash of block i of this same token list (they are trusted, not
    recomputed). `first_keys` are the first block's extra keys (see `first_block_keys`). Stops at
    `max_blocks` hashes in all if given (so a caller need not slice a long token list). Returns
    how many hashes were appended; a trailing partial block is never hashed.
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    start = len(hashes)
    parent = hashes[-1] if hashes else None
    for i in range(start, num_full):
        begin = i * block_size
        parent = hash_block(parent, token_ids[begin : begin + block_size], first_keys if i == 0 else ())
        hashes.append(parent)
    return max(0, num_full - start)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    model_id: str,
    start_hashes: list[int] | None = None,
) -> list[int]:
    """Hashes of every full block of `token_ids`, as a new list (the router's entry point).

    `start_hashes`, if given, are the already known hashes of the first blocks of this token list
    (a growing sequence); they are copied, not recomputed, and the list passed in is not changed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes = list(start_hashes) if start_hashes else []
    extend_block_hashes(hashes, token_ids, block_size, first_block_keys(cache_salt, model_id))
    return hashes


class PrefixHasher:
    """`hash_prompt_blocks` for one model, remembering recent blocks: prompts that share a system prompt
    hash its blocks once, not once per request (the router hashes every prompt it routes).

    The same chain of `hash_block` calls, so the hashes equal `hash_prompt_blocks`' exactly."""

    def __init__(self, block_size: int, model_id: str, capacity: int = 1 << 18):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size, self._model_id, self._capacity = block_size, model_id, capacity
        self._memo: dict[tuple, int] = {}

    def __call__(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        tokens = tuple(token_ids)
        bs, memo = self._block_size, self._memo
        hashes: list[int] = []
        parent = None
        for i in range(len(tokens) // bs):
            block = tokens[i * bs:(i + 1) * bs]
            key = (parent, block) if i else (None, block, cache_salt)
            h = memo.get(key)
            if h is None:
                if len(memo) >= self._capacity:
                    memo.clear()  # (rare; a cold start costs one uncached prompt per system prompt)
                h = memo[key] = hash_block(parent, block, first_block_keys(cache_salt, self._model_id) if i == 0 else ())
            hashes.append(h)
            parent = h
        return hashes
