"""Where one attempt's KV stands on a worker: the one description of the handoff that the engine, both
workers' lease tables and a worker's announcement to a restarted scheduler share.

A prefill worker computes a prompt (RUNNING), sends its pages and keeps its blocks until the decode
worker has them (HELD); the decode worker sets blocks aside for those pages (RESERVED) and, once they
land, decodes (RUNNING). Every other move is a bug, refused where it would happen (`check_move`); ending
(abort, finish, lease expiry) leaves any phase.
"""

from __future__ import annotations

import enum


class HandoffPhase(enum.Enum):
    RUNNING = "running"  # in the engine's batcher: waiting, prefilling or decoding
    RESERVED = "reserved"  # decode: blocks set aside for the prompt's pages, which another worker writes
    HELD = "held"  # prefill: first token out, pages sent, blocks kept until the decode worker has its copy


MOVES: dict[HandoffPhase, frozenset[HandoffPhase]] = {
    HandoffPhase.RESERVED: frozenset({HandoffPhase.RUNNING}),  # the pages landed: adopted
    HandoffPhase.RUNNING: frozenset({HandoffPhase.HELD}),  # prefilled and sent on
    HandoffPhase.HELD: frozenset(),  # only released (ended)
}


def check_move(before: HandoffPhase, after: HandoffPhase) -> None:
    if after not in MOVES[before]:
        raise RuntimeError(f"illegal handoff move {before.name} -> {after.name}")
