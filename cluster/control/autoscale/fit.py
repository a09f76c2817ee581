"""Fitting the linear cost model on timed steps: the profiler's in-process samples (experiments/planner)
and a running worker's steps timed end to end (`GET /admin/steps`, actors/worker/step_log.py).

Both fit prefill-only and decode-only steps apart, each with its own base, by non-negative least squares
on relative error (a 40 ms decode step matters as much as a 2 s prefill). A worker's log holds thousands
of steps, most of a few shapes: they are first grouped by shape (buckets of similar tokens, sequences and
context) and each group enters the fit once, as its medians, so that the common shape does not drown the
rest and one step stalled by the machine does not move the fit. A step that mixes a prefill chunk with
decodes (a colocated worker) is not fitted: the model charges it both parts and the larger base.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace

import numpy as np

from actors.worker.step_log import StepRecord
from cluster.control.autoscale.profile import EngineProfile, LinearCost

MIN_STEPS = 3  # steps of a kind below which its half of the model cannot be fitted from a log


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min sum((x @ coef - y) / y)^2 with coef >= 0: the best unconstrained fit over column subsets."""
    w = x / y[:, None]
    best, best_err = np.zeros(x.shape[1]), np.inf
    for r in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), r):
            coef, *_ = np.linalg.lstsq(w[:, cols], np.ones(len(y)), rcond=None)
            if (coef < 0).any():
                continue
            err = float(((w[:, cols] @ coef - 1) ** 2).sum())
            if err < best_err:
                best_err, best = err, np.zeros(x.shape[1])
                best[list(cols)] = coef
    return best


def fit_worker_steps(steps: list[StepRecord], seconds: str = "period_s") -> tuple[LinearCost, dict]:
    """A linear cost fitted on worker steps, by their `seconds` (`period_s`, or `engine_s` for the engine
    alone); with what it was fitted on. Raises if either kind of step is too rare."""
    prefill = [s for s in steps if s.prefill_tokens and not s.decode_seqs]
    decode = [s for s in steps if s.decode_seqs and not s.prefill_tokens]
    for kind, picked in (("prefill-only", prefill), ("decode-only", decode)):
        if len(picked) < MIN_STEPS:
            raise ValueError(f"{len(picked)} {kind} steps in the log, need {MIN_STEPS}: send it traffic of that kind")
    p_groups = _medians(prefill, lambda s: (s.prefill_tokens // 32, s.prefill_pairs // s.prefill_tokens // 128),
                        ("prefill_tokens", "prefill_pairs"), seconds)
    d_groups = _medians(decode, lambda s: (s.decode_seqs, s.decode_context // s.decode_seqs // 128),
                        ("decode_seqs", "decode_context"), seconds)
    p = fit_nonnegative(np.array([[1, g["prefill_tokens"], g["prefill_pairs"]] for g in p_groups], float),
                        np.array([g["s"] for g in p_groups]))
    d = fit_nonnegative(np.array([[1, g["decode_seqs"], g["decode_context"]] for g in d_groups], float),
                        np.array([g["s"] for g in d_groups]))
    used = {"steps": len(steps), "prefill_steps": len(prefill), "decode_steps": len(decode),
            "mixed_steps": len(steps) - len(prefill) - len(decode), "prefill_groups": len(p_groups),
            "decode_groups": len(d_groups), "seconds": seconds}
    return LinearCost(*p, *d), used


def _medians(steps: list[StepRecord], key, features: tuple[str, ...], seconds: str) -> list[dict]:
    """Per group of similar steps: the median of each feature and of the seconds (groups of 0 s dropped)."""
    groups: dict = {}
    for s in steps:
        groups.setdefault(key(s), []).append(s)
    out = []
    for members in groups.values():
        s = statistics.median(getattr(m, seconds) for m in members)
        if s > 0:
            out.append({**{f: statistics.median(getattr(m, f) for m in members) for f in features}, "s": s})
    return out


def refit(base: EngineProfile, steps: list[StepRecord], where: str, seconds: str = "period_s") -> EngineProfile:
    """`base` (its model, limits and transfer) with the step cost fitted on a worker log's `steps`."""
    cost, used = fit_worker_steps(steps, seconds)
    return replace(base, source="worker steps", cost=cost, samples=[{"fitted_on": used, "where": where}],
                   hardware=f"{base.hardware}; cost fitted on {used['steps']} steps of {where} ({seconds})")
