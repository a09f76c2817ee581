"""The simulator with pools that change size while it runs: what an autoscaler is evaluated on.

    run = simulate_elastic(profile, Layout.disaggregated(2, 2), requests, controller, interval_s=30)
    run.result (a SimResult, as `simulate` gives), run.machine_s, run.timeline

Every `interval_s` the `controller` is called with the interval's `Window` (what arrived, what got its
first token, what finished) and the pools' sizes; it returns the sizes it wants (or None). Resizing
follows the real scaling path (cluster/control/lifecycle/scaling.py):

- a new worker is a machine that starts now and serves after `start_s` (process start + weights);
- a removed worker drains: it takes nothing new, finishes what it holds, then its machine is released
  (the newest workers go first, a starting one at once);
- with `flip_s` set, a pool that grows while another shrinks at the same decision takes the draining
  machines first: each serves in its new role `flip_s` after it has drained, without a cold start; but
  only a machine whose drain may end (its longest answer at its current step cost, after the age of its
  oldest reservation still waiting for KV) `flip_s` before a cold start would serve, as scaling.py
  decides: the others drain and go, and new machines start cold.

As the product's autoscaler resizes (`scaling.scale(..., wait=False)`): a resize that would shrink a pool
while one of its workers is still starting is refused (the controller asks again at its next tick), and
with `blocking` the controller is not asked again until the last resize's flips serve in their new roles
(new workers start and removed ones drain without holding it); the ticks it missed reach it as one window.

Cost is machine-seconds up to `end_s`: from a machine's start to its release (or `end_s`), the starting,
draining and flipping time included, as a cloud bills it; a static layout of N workers costs N x `end_s`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.control.autoscale.profile import EngineProfile
from experiments.capacity.sim_worker import SimSeq, SimWorker
from experiments.capacity.simulator import Layout, SimOptions, SimResult, _Cluster
from experiments.capacity.workload import SimRequest


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float
    arrived: list[SimSeq]
    first_tokens: list[SimSeq]  # got their first token in the window
    finished: list[SimSeq]  # finished in the window
    queued: list[SimSeq]  # at the window's end: arrived, not failed, no first token yet
    decoding: list[SimSeq]  # at the window's end: placed (KV reserved on a decode worker), not finished
    decode_step_s: tuple[float, ...] = ()  # at the window's end: each serving decode (or colocated) worker's step
    serving: dict[str, int] | None = None  # at the window's end: workers per role serving (starting, draining: not)

    def then(self, later: "Window") -> "Window":
        """This window and the next as one: what happened in either, the state at the later one's end."""
        return Window(self.start_s, later.end_s, self.arrived + later.arrived, self.first_tokens + later.first_tokens,
                      self.finished + later.finished, later.queued, later.decoding, later.decode_step_s,
                      later.serving)


Controller = Callable[[Window, dict[str, int]], "dict[str, int] | None"]


@dataclass(frozen=True)
class Change:
    at_s: float
    sizes: dict[str, int]  # what the controller asked for
    flips: int  # machines that change role for it


@dataclass
class ElasticRun:
    result: SimResult
    machine_s: float
    end_s: float
    timeline: list[tuple[float, dict[str, int]]]  # (time, workers per role, starting ones included) at each change
    changes: list[Change] = field(default_factory=list)


class _Elastic(_Cluster):
    def __init__(self, profile: EngineProfile, layout: Layout, options: SimOptions, controller: Controller,
                 interval_s: float, start_s: float, flip_s: float | None, blocking: bool = False):
        super().__init__(dict.fromkeys(("prefill", "decode", "colocated"), profile), layout, options)
        self.profile_of = profile
        self.controller, self.interval_s, self.start_s, self.flip_s = controller, interval_s, start_s, flip_s
        self.ids = {role: itertools.count(sum(1 for w in self.workers.values() if w.role == role))
                    for role in ("prefill", "decode", "colocated")}
        self.machine_start = {wid: 0.0 for wid in self.workers}  # worker id -> when its machine started
        self.ready_at = dict.fromkeys(self.workers, 0.0)
        self.draining: set[str] = set()  # taking nothing new, not yet idle
        self.released: dict[str, float] = {}  # worker id -> when its machine was released (or flipped)
        self.flip_to: dict[str, str] = {}  # draining worker -> the role its machine takes next
        self.changes: list[Change] = []
        self.blocking = blocking
        self.pending: set[str] = set()  # blocking: the flips the last resize still waits for
        self._missed: Window | None = None  # blocking: the windows of the ticks a resize held back
        self._now = 0.0  # the event being handled: what `_views` (called from the base class) serves at
        self.timeline: list[tuple[float, dict[str, int]]] = [(0.0, self.pool_sizes())]

    def run_until(self, requests: list[SimRequest], end_s: float) -> ElasticRun:
        self.end_s = end_s
        t = self.interval_s
        while t < end_s:
            self._push(t, "tick", t)
            t += self.interval_s
        result = self.run(requests)
        machine_s = sum(min(self.released.get(wid, end_s), end_s) - started
                        for wid, started in self.machine_start.items() if started is not None and started < end_s)
        return ElasticRun(result, machine_s, end_s, self.timeline, self.changes)

    # ---- who serves ----

    def _live(self, role: str) -> list[str]:
        """Workers of a role that are or will be serving (starting ones too), oldest first."""
        return [wid for wid, w in self.workers.items()
                if w.role == role and wid not in self.draining and wid not in self.released]

    def pool_sizes(self) -> dict[str, int]:
        """Workers per role, starting ones included: the sizes the controller asked for."""
        roles = ("colocated",) if self.layout.mode == "colocated" else ("prefill", "decode")
        return {role: len(self._live(role)) for role in roles}

    def _views(self, role: str):
        now = self._now
        return [v for v in super()._views(role)
                if v.worker_id not in self.draining and v.worker_id not in self.released
                and self.ready_at[v.worker_id] <= now]

    # ---- events ----

    def _handle(self, now: float, kind: str, obj) -> None:
        self._now = now
        if kind == "tick":
            self._tick(now, obj)
        elif kind == "ready":
            self.pending.discard(obj)
            self._admit(now)
        else:
            super()._handle(now, kind, obj)
            self._release_drained(now)

    def _tick(self, now: float, start: float) -> None:
        begin = start - self.interval_s
        seqs = self.seqs
        window = Window(begin, start,
                        [s for s in seqs if begin <= s.request.arrival_s < start],
                        [s for s in seqs if s.first_token_s is not None and begin <= s.first_token_s < start],
                        [s for s in seqs if s.finish_s is not None and begin <= s.finish_s < start],
                        [s for s in seqs if s.request.arrival_s < start and s.first_token_s is None
                         and s.rejected is None],
                        [s for s in seqs if s.submitted_s is not None and s.finish_s is None and s.rejected is None],
                        tuple(w.step_s for wid, w in self.workers.items() if w.role != "prefill" and w.step_s is not None
                              and wid in self._live(w.role) and self.ready_at[wid] <= now),
                        {role: sum(1 for wid in self._live(role) if self.ready_at[wid] <= now)
                         for role in self.pool_sizes()})
        if self._missed is not None:
            window = self._missed.then(window)
            self._missed = None
        if self.blocking and self.pending:
            self._missed = window
            return
        wanted = self.controller(window, self.pool_sizes())
        if wanted:
            self._resize(now, wanted)

    def _resize(self, now: float, wanted: dict[str, int]) -> None:
        counts = self.pool_sizes()
        if any(n < counts.get(role, 0) and any(self.ready_at[w] > now for w in self._live(role))
               for role, n in wanted.items()):
            return  # refused, as scaling.py refuses it: a pool shrinks once its new workers serve
        spare: list[str] = []  # draining machines a growing pool may take (flips)
        for role, n in wanted.items():
            live = self._live(role)
            for wid in sorted(live, key=lambda w: (self.ready_at[w] <= now, -self.machine_start[w]))[:max(len(live) - n, 0)]:
                self._drain(now, wid)
                spare.append(wid)
        flips = 0
        for role, n in wanted.items():
            for _ in range(n - counts.get(role, 0)):
                mine = [w for w in spare if w in self.draining and self.flip_s is not None
                        and self._drain_eta_s(w, now) + self.flip_s < self.start_s]
                if mine:
                    spare.remove(mine[0])
                    self.flip_to[mine[0]] = role
                    self.pending.add(mine[0])  # until it serves in its new role
                    flips += 1
                else:
                    self._start(now, role, now + self.start_s, now)
        self.changes.append(Change(now, dict(wanted), flips))
        self._release_drained(now)
        self.timeline.append((now, self.pool_sizes()))

    def _start(self, now: float, role: str, ready_s: float, machine_start: float) -> str:
        wid = f"{role}-{next(self.ids[role])}"
        self.workers[wid] = self._new_worker(wid, role, self.profile_of)
        self.machine_start[wid], self.ready_at[wid] = machine_start, ready_s
        self._push(ready_s, "ready", wid)
        return wid

    def _drain_eta_s(self, wid: str, now: float) -> float:
        waiting = [now - s.submitted_s for s in self.seqs if s.decode_worker == wid and s.submitted_s is not None
                   and not s.adopted and s.first_token_s is None and s.rejected is None and s.prefill_worker != wid]
        return self.workers[wid].drain_eta_s(max(waiting, default=0.0))

    def _drain(self, now: float, wid: str) -> None:
        self.draining.add(wid)
        if self.ready_at[wid] > now:  # still starting: nothing to finish
            self.ready_at[wid] = now

    def _release_drained(self, now: float) -> None:
        for wid in [w for w in self.draining if self._idle(self.workers[w])]:
            self.draining.discard(wid)
            self.released[wid] = now
            self.pending.discard(wid)
            role = self.flip_to.pop(wid, None)
            if role is not None:  # the machine goes on in its new role: no new start, no release
                self.pending.add(self._start(now, role, now + self.flip_s, self.machine_start[wid]))
                self.machine_start[wid] = None  # its time is counted once, under the new id
                self.timeline.append((now, self.pool_sizes()))

    @staticmethod
    def _idle(w: SimWorker) -> bool:
        return (not w.busy and not w.waiting and not w.prefilling and w.decode_count == 0
                and w.committed_blocks == 0 and w.free_blocks == w.limits.num_kv_blocks)


def simulate_elastic(profile: EngineProfile, layout: Layout, requests: list[SimRequest], controller: Controller,
                     interval_s: float, start_s: float = 60.0, flip_s: float | None = None,
                     options: SimOptions = SimOptions(), end_s: float | None = None, blocking: bool = False) -> ElasticRun:
    """Run `requests` from `layout`, the controller resizing the pools every `interval_s` until `end_s`
    (default: the last arrival)."""
    if interval_s <= 0 or start_s < 0 or (flip_s is not None and flip_s < 0):
        raise ValueError(f"interval_s must be > 0 and start_s, flip_s >= 0; got {interval_s}, {start_s}, {flip_s}")
    requests = list(requests)
    end = end_s if end_s is not None else max((r.arrival_s for r in requests), default=0.0)
    return _Elastic(profile, layout, options, controller, interval_s, start_s, flip_s, blocking).run_until(requests, end)
