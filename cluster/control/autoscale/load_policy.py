"""`autoscaler.mode: load`: pool sizes from queue depth and KV use, one worker at a time.

A pool grows by one when a signal of it passes its high threshold, and shrinks by one only when every
signal of it is below its low threshold: between the two nothing moves (hysteresis). A step of one per
decision, with the autoscaler's cool-down between resizes, keeps a noisy interval from swinging the
pools; Dynamo's load-based planner adjusts the same way.

Signals: a prefill (or colocated) pool's prompts queued per worker, in seconds of work; a decode (or
colocated) pool's committed KV fraction, and any request waiting for KV room. Under a total budget
(`autoscaler.max_workers`), shrinking pools give their workers first, then the growing pool with the
most pressure (its signal over its threshold) is served first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.control.scheduler.pool_load import PoolLoad
from cluster.control.config import LoadThresholds


@dataclass(frozen=True)
class Bounds:
    least: int
    most: int


@dataclass(frozen=True)
class Decision:
    replicas: dict[str, int]  # the new size of each pool that changes
    reasons: dict[str, str] = field(default_factory=dict)  # why, for every pool (changed or not)


def pressure(load: PoolLoad, t: LoadThresholds) -> float:
    """The pool's strongest signal as a multiple of its high threshold (> 1: grow)."""
    signals = []
    if load.role in ("prefill", "colocated"):
        signals.append(load.queue_s_per_worker / t.prefill_queue_high_s)
    if load.role in ("decode", "colocated"):
        signals.append(load.kv_used / t.kv_high)
        if load.waiting:
            signals.append(float("inf"))
    return max(signals)


def idle(load: PoolLoad, t: LoadThresholds) -> bool:
    """Every signal of the pool below its low threshold."""
    if load.role in ("prefill", "colocated") and load.queue_s_per_worker >= t.prefill_queue_low_s:
        return False
    if load.role in ("decode", "colocated") and (load.kv_used >= t.kv_low or load.waiting):
        return False
    return True


def describe(load: PoolLoad) -> str:
    parts = [f"{load.workers} workers"]
    if load.role in ("prefill", "colocated"):
        parts.append(f"{load.queue_s_per_worker:.2f}s of prompts queued per worker")
    if load.role in ("decode", "colocated"):
        parts.append(f"KV {load.kv_used:.0%} committed, {load.waiting} waiting for room")
    return ", ".join(parts)


def decide(loads: dict[str, PoolLoad], current: dict[str, int], bounds: dict[str, Bounds], t: LoadThresholds,
           max_workers: int | None) -> Decision:
    """The pools to resize (`current`: their replica counts now) and why."""
    target = dict(current)
    reasons: dict[str, str] = {}
    growing = []
    for role, load in loads.items():
        p = pressure(load, t)
        if p > 1.0 and current[role] < bounds[role].most:
            growing.append((p, role))
            reasons[role] = f"grow: {describe(load)}"
        elif idle(load, t) and current[role] > bounds[role].least:
            target[role] = current[role] - 1
            reasons[role] = f"shrink: {describe(load)}"
        else:
            why = "at its bound" if p > 1.0 or idle(load, t) else "between thresholds"
            reasons[role] = f"hold ({why}): {describe(load)}"
    room = None if max_workers is None else max_workers - sum(target.values())
    for _, role in sorted(growing, reverse=True):
        if room is not None and room < 1:
            reasons[role] = reasons[role].replace("grow:", "hold (autoscaler.max_workers reached):", 1)
            continue
        target[role] = current[role] + 1
        room = None if room is None else room - 1
    return Decision({role: n for role, n in target.items() if n != current[role]}, reasons)
