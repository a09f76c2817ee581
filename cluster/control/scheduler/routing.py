"""Routing policies: which prefill worker computes a prompt, and which decode worker continues it.

Pure functions over snapshots of worker state, so the policy is tested without a cluster. The
cache-aware policy minimises predicted time to first token: queue wait + uncached prompt tokens x
measured per-token prefill cost + the KV handoff's cost on the link to the decode worker (measured,
cluster/control/scheduler/link_costs.py). A request with an affinity key (`prompt_cache_key`) goes where the
key's last request went, unless the prefix index knows a deeper hit elsewhere or that worker is too busy
(`prefer_affine`, `pick_decode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


ANY_TENANT = object()  # predicted_ttft: count the whole queue (a batcher that does not take tenants in turn)

# How much longer than on the policy's choice a request may be predicted to wait for its first token on the
# worker its affinity key last went to, in prefills of its own prompt there. That worker likely holds the
# prompt up to the key's last request, which the prefix index may not know yet (unreported, or shorter than a
# block): the wait buys the cluster a prefill it need not compute, so it is worth more than one prompt's time;
# past a few, the key's worker is overloaded and load decides.
AFFINITY_SLACK_PROMPTS = 4.0
# ... and at least this long: differences this small are the predictions' noise (queued tokens are estimates
# until the worker's next report, link costs are measured on a shared host), not a busy worker.
AFFINITY_SLACK_FLOOR_S = 0.05


@dataclass
class WorkerView:
    worker_id: str
    role: str  # prefill | decode | colocated
    free_blocks: int
    num_blocks: int
    queued_prefill_tokens: int = 0  # prompt tokens waiting or mid-prefill
    running: int = 0
    waiting: int = 0
    prefill_s_per_token: float | None = None  # measured; None until the worker has prefilled
    queued_by_tenant: dict[str | None, int] = field(default_factory=dict)  # the same tokens by tenant (cache salt)


@dataclass(frozen=True)
class PrefillPlan:
    worker_id: str
    local: bool  # prefill on the decode worker itself: no transfer
    cached_tokens: int
    predicted_ttft_s: float


def predicted_ttft(view: WorkerView, prompt_len: int, cached_tokens: int, default_cost: float,
                   transfer_s: float, tenant: object = ANY_TENANT, step_tokens: int | None = None) -> float:
    """Prefill work ahead of the prompt on the worker, and its own, x the per-token cost, + the handoff.

    For a `tenant` (a request's cache salt), on a worker whose batcher takes the tenants in turn: each other
    tenant's queue counts only up to the tenant's own work (its queued prompts and this one), as if the
    worker shared its steps equally; a flood of one tenant then does not count in full against another's
    prompt. But the step in flight is no one's to share: where others have prompts queued, the worker may
    be a whole step (`step_tokens`, the most prompt tokens a step there computes) into theirs, which the
    prompt waits out (measured: a short prompt sent behind a flood of 2,000-token prompts waited ~100 ms,
    10x its unloaded first token, in two runs of five). Without a tenant (`ANY_TENANT`), the queue counts
    whole, first come first served."""
    cost = view.prefill_s_per_token or default_cost
    uncached = max(prompt_len - cached_tokens, 1)
    if tenant is ANY_TENANT or not view.queued_by_tenant:
        return (view.queued_prefill_tokens + uncached) * cost + transfer_s
    own = view.queued_by_tenant.get(tenant, 0) + uncached
    theirs = [tokens for t, tokens in view.queued_by_tenant.items() if t != tenant]
    ahead = sum(min(tokens, own) for tokens in theirs)
    if step_tokens is not None:
        ahead = max(ahead, min(sum(theirs), step_tokens))
    return min(view.queued_prefill_tokens + uncached, own + ahead) * cost + transfer_s


def plan_prefill(
    policy: str,
    prefill_workers: list[WorkerView],
    cached_tokens: dict[str, int],
    prompt_len: int,
    transfer_s: float | Mapping[str, float],
    default_cost: float,
    turn: int,
    local: WorkerView | None = None,
    local_penalty: float = 1.0,
    local_max_tokens: int | None = None,
    tenant: object = ANY_TENANT,
    local_overflow_s: float | None = None,
    step_tokens: int | None = None,
) -> PrefillPlan:
    """Pick the prefill worker; `local`, if given, is the chosen decode worker as a candidate too, for a
    prompt of at most `local_max_tokens` uncached tokens there (None: any), taken when predicted (1 +
    `local_penalty`) times faster. `transfer_s`: the handoff's cost from each prefill worker (by id), or one
    for all. `tenant`: whose prompt it is, where the workers take tenants in turn (`predicted_ttft`);
    `step_tokens`: the most prompt tokens a prefill worker's step computes (the decode worker's:
    `local_max_tokens`), the step in flight another tenant's prompt may hold.

    Overflow: where even the best prefill worker is predicted to take longer than `local_overflow_s` to the
    first token (the prefill pool is short: a burst, or a pool still growing), the decode worker takes a
    prompt of any length whenever it is predicted faster at all. It computes at most `local_max_tokens` of
    it a step (the decode worker's prompt cap, `Batcher.max_prefill_tokens`), so its decodes slow no more
    than a short local prompt slows them. The caller passes it only while one tenant is served
    (`RecentTenants`)."""
    def handoff_s(view: WorkerView) -> float:
        return transfer_s if isinstance(transfer_s, (int, float)) else transfer_s[view.worker_id]

    if not prefill_workers:
        raise ValueError("no prefill worker is registered")
    ordered = sorted(prefill_workers, key=lambda v: v.worker_id)
    if policy == "round_robin":
        chosen = ordered[turn % len(ordered)]
    elif policy == "least_loaded":
        chosen = min(ordered, key=lambda v: (v.queued_prefill_tokens, v.running + v.waiting))
    elif policy == "cache_aware":
        chosen = min(ordered, key=lambda v: predicted_ttft(v, prompt_len, cached_tokens.get(v.worker_id, 0),
                                                           default_cost, handoff_s(v), tenant, step_tokens))
    else:
        raise ValueError(f"unknown routing policy {policy!r}")
    cached = cached_tokens.get(chosen.worker_id, 0)
    remote = PrefillPlan(chosen.worker_id, False, cached,
                         predicted_ttft(chosen, prompt_len, cached, default_cost, handoff_s(chosen), tenant,
                                        step_tokens))
    if local is None:
        return remote
    local_cached = cached_tokens.get(local.worker_id, 0)
    overflow = local_overflow_s is not None and remote.predicted_ttft_s > local_overflow_s and local_max_tokens != 0
    if not overflow and local_max_tokens is not None and prompt_len - local_cached > local_max_tokens:
        return remote  # in one step there, a long prefill would stall the tokens of everything it decodes
    local_ttft = predicted_ttft(local, prompt_len, local_cached, default_cost, 0.0, tenant,
                                local_max_tokens if step_tokens is not None else None)
    if local_ttft * (1.0 + (0.0 if overflow else local_penalty)) < remote.predicted_ttft_s:
        return PrefillPlan(local.worker_id, True, local_cached, local_ttft)
    return remote


class RecentTenants:
    """The tenants (cache salts) whose requests were placed in the last `window_s` seconds: overflow prefill
    is for a cluster serving one of them. With several, one tenant's long prompts on a decode worker would
    run in the steps all of them share there."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self._seen: dict[object, float] = {}

    def saw(self, tenant: object, now: float) -> None:
        self._seen[tenant] = now
        if len(self._seen) > 1:
            self._seen = {t: at for t, at in self._seen.items() if now - at <= self.window_s}

    def alone(self, tenant: object, now: float) -> bool:
        """No other tenant was seen within the window (always, where tenants are not told apart)."""
        return tenant is ANY_TENANT or all(t == tenant or now - at > self.window_s for t, at in self._seen.items())

    def at_most_one(self, now: float) -> bool:
        """At most one tenant was seen within the window."""
        return sum(now - at <= self.window_s for at in self._seen.values()) <= 1


def pick_decode(decode_workers: list[WorkerView], blocks_needed: int, prefer: str | None = None) -> WorkerView | None:
    """The decode worker with the most free KV that can hold the request, or None; `prefer` (the worker the
    request's affinity key last went to) whenever it can hold it."""
    fits = [v for v in decode_workers if v.free_blocks >= blocks_needed]
    if not fits:
        return None
    preferred = [v for v in fits if v.worker_id == prefer]
    return preferred[0] if preferred else max(fits, key=lambda v: (v.free_blocks - v.running, v.worker_id))


def prefer_affine(plan: PrefillPlan, affine: WorkerView | None, local: bool, candidates: list[WorkerView],
                  cached_tokens: dict[str, int], prompt_len: int, default_cost: float, transfer_s: float,
                  tenant: object = ANY_TENANT) -> PrefillPlan:
    """`plan`, or the `affine` worker instead (the one the request's affinity key last went to; `local`: it is
    the decode worker itself, `transfer_s` its handoff's cost otherwise): taken when the prefix index knows no
    deeper hit on `plan`'s worker than on it, and it has room: its queue and this prompt would take at most
    `AFFINITY_SLACK_PROMPTS` of its own prefills of the prompt (or `AFFINITY_SLACK_FLOOR_S`) longer than on
    the least loaded of `candidates`. The handoff's cost is left out of that comparison: the key's decode worker
    is taken too (`pick_decode`), so the link is the one its last request took, and on one host the links'
    measured costs differ by their noise, not by what they cost."""
    if affine is None or affine.worker_id == plan.worker_id:
        return plan
    cached = cached_tokens.get(affine.worker_id, 0)
    if cached < plan.cached_tokens:
        return plan  # the index knows a deeper hit: blocks seen beat a hint

    def wait_s(view: WorkerView) -> float:
        return predicted_ttft(view, prompt_len, cached_tokens.get(view.worker_id, 0), default_cost, 0.0, tenant)

    least = min((wait_s(v) for v in candidates), default=0.0)
    slack_s = max(AFFINITY_SLACK_PROMPTS * prompt_len * (affine.prefill_s_per_token or default_cost),
                  AFFINITY_SLACK_FLOOR_S)
    if wait_s(affine) > least + slack_s:
        return plan
    return PrefillPlan(affine.worker_id, local, cached,
                       predicted_ttft(affine, prompt_len, cached, default_cost, 0.0 if local else transfer_s, tenant))
