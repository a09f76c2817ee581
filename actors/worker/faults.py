"""The chaos hooks a worker accepts (`Worker.inject_fault`), each with what it does; tests and
`tandem bench chaos` use them to make the failures the failure model names happen on demand."""

from __future__ import annotations

import threading
from typing import Callable

from actors.protocol.tp_messages import KvPiece

FAULTS = {
    "drop_kv_sends": "prefill: pages are lost on the wire",
    "ignore_kv_arrivals": "decode: pages land but are never adopted or acked",
    "hold_kv_writes": "decode: admitted pages wait until the faults are cleared, at most delay_s, before being written",
    "slow_reserve": "decode: a reservation takes delay_s longer",
    "kill_kv_receiver": "decode: the receiving thread stops, as if it had crashed: the worker exits and Ray restarts it",
    "drop_next_submit": "the next attempt sent here vanishes unseen",
    "slow_step": "the next engine step takes delay_s longer, as a long prefill on a slow CPU does",
    "slow_grammar": "the next structured-output grammar compile waits until the faults are cleared, at most delay_s, "
                    "as a large spec's takes long",
}


def check_fault(fault: str | None) -> None:
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


class Faults:
    """The faults set on one worker, as typed fields its paths read (no name lookups on the hot path).
    Injected and cleared on the engine thread; read there and by Ray's call threads."""

    def __init__(self, receiver, writes: "HeldWrites"):
        self._receiver, self._writes = receiver, writes
        self._grammar_released = threading.Event()  # cleared while a slow_grammar fault holds a compile
        self._grammar_released.set()
        self._clear()

    def _clear(self) -> None:
        self.drop_kv_sends = False
        self.ignore_kv_arrivals = False
        self.slow_reserve_s = 0.0
        self.drop_next_submit = False
        self.slow_step_s = 0.0  # once: the next step only
        self.slow_grammar_s = 0.0  # once: the next compile only

    def inject(self, fault: str | None, delay_s: float) -> None:
        """Set one fault of FAULTS (None: clear them all)."""
        if fault == "kill_kv_receiver":
            if self._receiver is not None:  # rank 0's
                self._receiver.close()
            return
        if fault is None:
            self._clear()
            self._writes.hold(None)
            self._grammar_released.set()
        elif fault == "hold_kv_writes":
            self._writes.hold(delay_s)
        elif fault == "slow_grammar":
            self._grammar_released.clear()
            self.slow_grammar_s = delay_s
        elif fault in ("slow_reserve", "slow_step"):
            setattr(self, f"{fault}_s", delay_s)
        else:
            setattr(self, fault, True)

    def take_step_delay(self) -> float:
        delay, self.slow_step_s = self.slow_step_s, 0.0
        return delay

    def take_grammar_delay(self) -> float:
        delay, self.slow_grammar_s = self.slow_grammar_s, 0.0
        return delay

    def hold_grammar(self, max_s: float) -> None:
        """A slow_grammar compile's wait (the grammar desk's thread): until the faults are cleared, at most
        `max_s`; a test then knows the compile is still going on for as long as it has not cleared them."""
        self._grammar_released.wait(max_s)

    def take_dropped_submit(self) -> bool:
        dropped, self.drop_next_submit = self.drop_next_submit, False
        return dropped


class HeldWrites:
    """`hold_kv_writes` as a wrapper around the handoff table's `admit` (what a receiver thread asks before
    it writes a piece), so the lease owner itself has no fault hook: while held, an admitted piece waits
    (up to `max_s`) before its pages are written."""

    def __init__(self, admit: Callable[[KvPiece], None]):
        self._admit = admit
        self._open = threading.Event()
        self._open.set()
        self._max_s = 0.0

    def __call__(self, piece: KvPiece) -> None:
        self._admit(piece)
        if not self._open.is_set():
            self._open.wait(self._max_s)

    def hold(self, max_s: float | None) -> None:
        """Admitted pieces wait up to `max_s` before being written; None lets them go."""
        self._max_s = max_s or 0.0
        if max_s is None:
            self._open.set()
        else:
            self._open.clear()
