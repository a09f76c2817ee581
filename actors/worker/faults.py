"""The chaos hooks a worker accepts (`Worker.inject_fault`), each with what it does; tests and
`tandem bench chaos` use them to make the failures the failure model names happen on demand."""

from __future__ import annotations

FAULTS = {
    "drop_kv_sends": "prefill: pages are lost on the wire",
    "ignore_kv_arrivals": "decode: pages land but are never adopted or acked",
    "hold_kv_writes": "decode: admitted pages wait until the faults are cleared, at most delay_s, before being written",
    "slow_reserve": "decode: a reservation takes delay_s longer",
    "kill_kv_receiver": "decode: the receiving thread stops, as if it had crashed: the worker exits and Ray restarts it",
    "drop_next_submit": "the next attempt sent here vanishes unseen",
    "slow_step": "the next engine step takes delay_s longer, as a long prefill on a slow CPU does",
}


def check_fault(fault: str | None) -> None:
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def apply_fault(faults: dict[str, float], fault: str | None, delay_s: float, receiver, handoffs) -> None:
    """On the engine thread: set (or, with None, clear) a fault in `faults`."""
    if fault == "kill_kv_receiver" and receiver is not None:  # rank 0's
        receiver.close()
        return
    if fault is None:
        faults.clear()
    else:
        faults[fault] = delay_s
    handoffs.hold_writes(faults.get("hold_kv_writes"))
