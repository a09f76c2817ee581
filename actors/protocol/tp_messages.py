"""Messages between the ranks of one tensor-parallel worker about a KV handoff. Who sends what:

prefill rank 0 -> its other ranks   `KvSendPlan` (a step plan's payload): every rank sends its own heads
decode rank r>0 -> decode rank 0    `PieceEvent` over a local zmq socket: may I write this piece
                                    ("admit", answered with `PieceVerdict`), and how its write ended
                                    ("landed" | "failed" | "refused")

Rank 0 alone keeps the leases (the handoff table); the other ranks write only pieces it admitted, and it
adopts an attempt once every rank reported every head of it landed.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.protocol.messages import KvRankEndpoint

PIECE_STAGES = ("admit", "landed", "failed", "refused")


@dataclass(frozen=True)
class KvSendPlan:
    """One handoff, as every rank of a prefill worker carries it out: each sends the heads it holds (the
    lowest rank holding a replicated head sends it) to each decode rank holding them."""

    lease_id: str
    src_block_ids: tuple[int, ...]
    dest_block_ids: tuple[int, ...]
    targets: tuple[KvRankEndpoint, ...]
    note: bytes
    timeout_s: float


@dataclass(frozen=True)
class KvPiece:
    """The pages one rank of a decode worker receives for a lease: some heads of the reserved blocks."""

    lease_id: str
    rank: int
    first_head: int
    num_heads: int
    dest_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PieceEvent:
    piece: KvPiece
    stage: str  # one of PIECE_STAGES
    error: str = ""  # why it failed or was refused
    note: bytes = b""  # the sender's HandoffNote (landed pieces)
    nbytes: int = 0  # page bytes written (landed pieces)

    def __post_init__(self) -> None:
        if self.stage not in PIECE_STAGES:
            raise ValueError(f"piece stage must be one of {PIECE_STAGES}, got {self.stage!r}")


@dataclass(frozen=True)
class PieceVerdict:
    piece: KvPiece  # the admit it answers
    error: str = ""  # empty: admitted, write it
    ended: bool = False  # the lease has ended (or the piece came twice): drop it, fail nothing
