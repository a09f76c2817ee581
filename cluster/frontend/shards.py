"""Which scheduler shard a request goes to, when a cluster runs several scheduler actors, each with its
own workers: by a hash of the prompt's first tokens and its tenant, so requests that share a system
prompt meet on one shard, where its prefix is cached, and a migrated request returns to its shard."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

LEADING_TOKENS = 32  # prompts that share this many first tokens share a shard


def shard_for(prompt_token_ids: Sequence[int], cache_salt: str | None, shards: int) -> int:
    if shards == 1:
        return 0
    lead = list(prompt_token_ids[:LEADING_TOKENS])
    h = hashlib.blake2b(struct.pack(f"<{len(lead)}q", *lead), digest_size=8, person=b"tandem-shard")
    h.update(b"N" if cache_salt is None else b"s" + cache_salt.encode())
    return int.from_bytes(h.digest(), "little") % shards
