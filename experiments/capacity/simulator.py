"""A discrete-event simulator of a tandem cluster: arrivals, admission, routing, batching, KV transfer.

    requests = [SimRequest(arrival_s, prompt_len, output_len), ...]
    result = simulate(profile, Layout.disaggregated(1, 1), requests)
    summary = summarize(result, SLO(ttft_s=1.0, tpot_s=0.05))   # metrics.py
    summary.goodput_rps, summary.ttft.p90

Events (a heapq ordered by time, then by creation order, so a run is deterministic): a request
arrives; a worker's step ends; a KV transfer lands. Policy, as in the real scheduler (cluster/control/scheduler/actor.py):

- Admission: requests wait in one FIFO queue until a decode (or colocated) worker can promise KV for
  prompt + output tokens; `pick_decode` (cluster/control/scheduler/routing.py) picks the decode worker with the most room.
- Prefill routing: `plan_prefill` from cluster/control/scheduler/routing.py itself, default "cache_aware" (least
  predicted TTFT = queued prefill tokens x the worker's measured per-token cost + transfer). There is
  no prefix cache in the simulator, so cache-aware reduces to least loaded by queued prompt tokens. With
  `local_prefill`, a prompt of up to `local_prefill_max_tokens` runs on the chosen decode worker when
  that is predicted (1 + penalty) times faster, and past `local_prefill_overflow_s` on the best prefill
  worker a prompt of any length when it is predicted faster at all, exactly the real rule (a trace is one
  tenant's, so overflow is never off for another's); a decode worker computes at most
  `local_prefill_max_tokens` prompt tokens a step, as the real one does.
- A prefill worker emits the first token when the prompt's last chunk ends (TTFT does not include the
  transfer), then sends the KV over its one outgoing link (transfers from one worker queue behind each
  other; each takes latency + bytes / bandwidth) and frees its blocks when the KV has landed. The decode
  worker adopts the request and decodes it from its next step.
- Workers step as `SimWorker` (sim_worker.py) describes; a step lasts `profile.step_s(shape)`.
- Leases: the decode worker's reservation is made on admission and lasts `lease_s`; KV that lands later
  is refused and the request fails without a token, as the real worker does (so an overloaded prefill
  pool shows up as failures, not only as long TTFTs).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from cluster.control.autoscale.profile import EngineProfile
from cluster.control.config import LOCAL_PREFILL_MAX_TOKENS, LOCAL_PREFILL_OVERFLOW_S
from cluster.control.scheduler.routing import WorkerView, pick_decode, plan_prefill
from experiments.capacity.sim_worker import SimSeq, SimWorker
from experiments.capacity.workload import SimRequest


@dataclass(frozen=True)
class Layout:
    mode: str  # disaggregated | colocated
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    # GPUs (tensor-parallel ranks) per worker of each pool; the costs of a pool come from the profile of its size.
    prefill_tp: int = 1
    decode_tp: int = 1
    colocated_tp: int = 1

    def __post_init__(self) -> None:
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1 or self.colocated):
            raise ValueError(f"a disaggregated layout needs >= 1 prefill and >= 1 decode worker, got {self}")
        if self.mode == "colocated" and (self.colocated < 1 or self.prefill or self.decode):
            raise ValueError(f"a colocated layout needs >= 1 colocated worker and no pools, got {self}")
        if self.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"layout mode must be 'disaggregated' or 'colocated', got {self.mode!r}")

    @classmethod
    def disaggregated(cls, prefill: int, decode: int) -> "Layout":
        return cls("disaggregated", prefill=prefill, decode=decode)

    @classmethod
    def colocated_workers(cls, n: int) -> "Layout":
        return cls("colocated", colocated=n)

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def num_gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp + self.colocated * self.colocated_tp

    def tp(self, role: str) -> int:
        return {"prefill": self.prefill_tp, "decode": self.decode_tp, "colocated": self.colocated_tp}[role]

    def describe(self) -> str:
        def pool(n: int, letter: str, tp: int) -> str:
            return f"{n}{letter}" + (f"x{tp}" if tp > 1 else "")

        if self.mode == "disaggregated":
            return f"{pool(self.prefill, 'P', self.prefill_tp)}:{pool(self.decode, 'D', self.decode_tp)}"
        return pool(self.colocated, "C", self.colocated_tp)

    @classmethod
    def from_config(cls, config) -> "Layout":
        """The layout a `TandemConfig` (cluster/control/config.py) starts."""
        if config.mode == "colocated":
            return cls("colocated", colocated=config.colocated.replicas,
                       colocated_tp=config.colocated.tensor_parallel_size)
        return cls("disaggregated", prefill=config.prefill.replicas, decode=config.decode.replicas,
                   prefill_tp=config.prefill.tensor_parallel_size, decode_tp=config.decode.tensor_parallel_size)


@dataclass(frozen=True)
class SimOptions:
    routing: str = "cache_aware"  # cache_aware | least_loaded | round_robin (cluster/control/scheduler/routing.py)
    local_prefill: bool = True
    local_prefill_penalty: float = 1.0
    local_prefill_max_tokens: int | None = LOCAL_PREFILL_MAX_TOKENS  # on a decode worker's own prefill
    local_prefill_overflow_s: float | None = LOCAL_PREFILL_OVERFLOW_S  # ... past which it takes any prompt
    default_prefill_s_per_token: float = 2e-4  # the scheduler's guess until a worker has measured itself
    lease_s: float | None = None  # a decode reservation's lifetime; None never expires

    @classmethod
    def from_config(cls, config) -> "SimOptions":
        """The routing policy of a `TandemConfig`'s scheduler section."""
        s = config.scheduler
        return cls(s.routing, s.local_prefill, s.local_prefill_penalty, s.local_prefill_max_tokens,
                   s.local_prefill_overflow_s, s.prefill_s_per_token, s.lease_s)


@dataclass
class SimResult:
    layout: Layout
    seqs: list[SimSeq]  # one per request, in request order
    step_ends: dict[str, list[float]] = field(default_factory=dict)  # worker -> end time of each step

    def token_times(self, seq: SimSeq) -> list[float]:
        """Emit time of each output token (empty if the request never got its first token)."""
        if seq.first_token_s is None:
            return []
        times = [seq.first_token_s]
        if seq.request.output_len > 1 and seq.decode_first_step is not None:
            ends = self.step_ends[seq.decode_worker]
            times += ends[seq.decode_first_step: seq.decode_first_step + seq.request.output_len - 1]
        return times


class _Cluster:
    def __init__(self, profiles: dict[str, EngineProfile], layout: Layout, options: SimOptions):
        self.layout, self.options = layout, options
        roles = [("prefill", layout.prefill), ("decode", layout.decode), ("colocated", layout.colocated)]
        self.workers = {f"{role}-{i}": self._new_worker(f"{role}-{i}", role, profiles[role]) for role, n in roles
                        for i in range(n)}
        self.pool = "colocated" if layout.mode == "colocated" else "decode"
        self.profile = profiles[self.pool]  # the pool that holds a request's KV while it decodes
        self.sender = profiles["prefill" if layout.mode == "disaggregated" else self.pool]
        self.events: list = []
        self.order = itertools.count()
        self.turn = itertools.count()
        self.admission: deque[SimSeq] = deque()

    def run(self, requests: list[SimRequest]) -> SimResult:
        self.seqs = seqs = [SimSeq(i, r) for i, r in enumerate(requests)]
        for seq in seqs:
            self._push(seq.request.arrival_s, "arrive", seq)
        while self.events:
            now, _, kind, obj = heapq.heappop(self.events)
            self._handle(now, kind, obj)
        return SimResult(self.layout, seqs, {wid: w.step_ends for wid, w in self.workers.items()})

    def _handle(self, now: float, kind: str, obj) -> None:
        if kind == "arrive":
            self.admission.append(obj)
            self._admit(now)
        elif kind == "step":
            self._step_done(now, obj)
        else:
            self._transfer_done(now, obj)

    def _push(self, t: float, kind: str, obj) -> None:
        heapq.heappush(self.events, (t, next(self.order), kind, obj))

    # ---- scheduler ----

    def _blocks_needed(self, r: SimRequest) -> int:
        return -(-(r.prompt_len + r.output_len) // self.profile.engine.block_size)

    def _admit(self, now: float) -> None:
        while self.admission:
            seq = self.admission[0]
            needed = self._blocks_needed(seq.request)
            if needed > self.profile.engine.num_kv_blocks:
                self.admission.popleft()
                seq.rejected = f"needs {needed} KV blocks; a worker has {self.profile.engine.num_kv_blocks}"
                continue
            if not self._place(seq, needed, now):
                return  # FIFO: later requests wait behind the head until KV frees up
            self.admission.popleft()

    def _new_worker(self, worker_id: str, role: str, profile: EngineProfile) -> SimWorker:
        """As the cluster starts one: a decode worker computes at most local_prefill_max_tokens of a prompt
        a step (the launcher sets that cap on every worker; the engine applies it in the decode role)."""
        return SimWorker(worker_id, role, profile, decode_prompt_cap=self.options.local_prefill_max_tokens or None)

    def _views(self, role: str) -> list[WorkerView]:
        return [WorkerView(w.worker_id, role, w.limits.num_kv_blocks - w.committed_blocks, w.limits.num_kv_blocks,
                           w.queued_prefill_tokens(), w.running, len(w.waiting), w.prefill_s_per_token)
                for w in self.workers.values() if w.role == role]

    def _typical_cost(self, views: list[WorkerView]) -> float:
        measured = [v.prefill_s_per_token for v in views if v.prefill_s_per_token is not None]
        return sum(measured) / len(measured) if measured else self.options.default_prefill_s_per_token

    def _place(self, seq: SimSeq, needed: int, now: float) -> bool:
        prompt_len, o = seq.request.prompt_len, self.options
        if self.layout.mode == "colocated":
            views = self._views("colocated")
            fits = [v for v in views if v.free_blocks >= needed]
            if not fits:
                return False
            plan = plan_prefill(o.routing, fits, {}, prompt_len, 0.0, self._typical_cost(views), next(self.turn))
            self._submit(seq, self.workers[plan.worker_id], self.workers[plan.worker_id], needed, now)
            return True
        decode = pick_decode(self._views("decode"), needed)
        if decode is None:
            return False
        prefill_views = self._views("prefill")
        transfer_s = self.sender.transfer_s(prompt_len)
        plan = plan_prefill(o.routing, prefill_views, {}, prompt_len, transfer_s, self._typical_cost(prefill_views),
                            next(self.turn), local=decode if o.local_prefill else None,
                            local_penalty=o.local_prefill_penalty, local_max_tokens=o.local_prefill_max_tokens,
                            local_overflow_s=o.local_prefill_overflow_s)
        if seq.request.output_len == 1 and not plan.local:
            needed = 0  # a one-token request finishes on the prefill worker: nothing to reserve
        self._submit(seq, self.workers[plan.worker_id], self.workers[decode.worker_id], needed, now)
        return True

    def _submit(self, seq: SimSeq, prefill: SimWorker, decode: SimWorker, blocks: int, now: float) -> None:
        seq.prefill_worker, seq.decode_worker = prefill.worker_id, decode.worker_id
        seq.submitted_s = now
        decode.committed_blocks += blocks
        prefill.waiting.append(seq)
        self._wake(prefill, now)

    # ---- workers ----

    def _wake(self, worker: SimWorker, now: float) -> None:
        if worker.busy:
            return
        shape = worker.start_step()
        if shape is not None:
            duration = worker.profile.step_s(shape)
            self._push(now + duration, "step", (worker, duration))

    def _step_done(self, now: float, item: tuple[SimWorker, float]) -> None:
        worker, duration = item
        completed, finished = worker.finish_step(now, duration)
        if worker.role == "prefill":
            for seq in completed:
                if seq.request.output_len > 1:
                    start = max(now, worker.link_free_s)
                    worker.link_free_s = start + worker.profile.transfer_s(seq.request.prompt_len)
                    self._push(worker.link_free_s, "transfer", seq)
                else:
                    worker.free_blocks += seq.blocks_held
                    seq.blocks_held = 0
        for seq in finished:
            if seq.request.output_len > 1 or seq.prefill_worker == seq.decode_worker:
                self.workers[seq.decode_worker].committed_blocks -= self._blocks_needed(seq.request)
        self._wake(worker, now)
        if finished:
            self._admit(now)

    def _transfer_done(self, now: float, seq: SimSeq) -> None:
        prefill = self.workers[seq.prefill_worker]
        prefill.free_blocks += seq.blocks_held
        seq.blocks_held = 0
        decode = self.workers[seq.decode_worker]
        if self.options.lease_s is not None and now - seq.submitted_s > self.options.lease_s:
            seq.rejected, seq.first_token_s = f"KV arrived after the {self.options.lease_s:g} s lease", None
            decode.committed_blocks -= self._blocks_needed(seq.request)
            self._wake(prefill, now)
            self._admit(now)
            return
        seq.adopted = True
        decode.waiting.append(seq)
        self._wake(decode, now)
        self._wake(prefill, now)


def simulate(profile: EngineProfile | dict[int, EngineProfile], layout: Layout, requests: list[SimRequest],
             options: SimOptions = SimOptions()) -> SimResult:
    """Run `requests` (arrival times in seconds, any order) through `layout`; the result keeps their order.
    `profile`: one for every worker, or one per tensor-parallel size (each pool takes its size's)."""
    if not isinstance(profile, dict):
        profiles = dict.fromkeys(("prefill", "decode", "colocated"), profile)
    else:
        roles = [r for r in ("prefill", "decode", "colocated") if getattr(layout, r)]
        missing = sorted({layout.tp(r) for r in roles} - profile.keys())
        if missing:
            raise ValueError(f"layout {layout.describe()} needs a profile for tensor_parallel {missing}")
        profiles = {role: profile[layout.tp(role)] for role in roles}
    return _Cluster(profiles, layout, options).run(list(requests))
