"""`tandem bench control-plane`: how far one scheduler actor scales, measured with simulated workers.

N simulated workers (experiments/fleet/, half prefill, half decode, many to a process) register with the
real scheduler actor; the real Python client (the HTTP ingress's path: `asubmit`, submits batched per
tick, tokens over zmq) drives an open-loop Poisson load whose prompts share a few system prompts (so
the prefix index and cache-aware routing have work to do). Per point (N, rate) it reports admissions/s
sustained, the scheduler's decision time (a submit's arrival at the scheduler to its attempt sent to
the prefill worker) p50/p99, the time a request spends outside the workers (TTFT minus the prefill
worker's own received -> first token time), the scheduler's CPU and memory and its prefix-index size;
with several points, PNGs of decision time vs N and vs rate beside the JSON. `--shards S` runs S
scheduler actors, each with its share of the workers, the client choosing by the prompt's prefix.

Everything runs on this machine: the scheduler, the simulated hosts and the load generator share its
cores, so the report also gives the load generator's CPU and the hosts' step lateness, to show which
of them ran out first.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import time

import ray

from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.client import AdmissionRejected, TandemClient
from experiments.bench_report import add_out_argument, out_path, summary_line, write_json
from cluster.control.scheduler.decision_clock import ControlPlaneStats
from experiments.fleet.control_plane_plots import decision_plots
from experiments.fleet.fleet import Fleet
from experiments.fleet.sim_worker import SimSpec

WARMUP_S = 2.0
DRAIN_S = 30.0


@dataclasses.dataclass(frozen=True)
class PromptMix:
    system_prompts: int = 16
    system_tokens: int = 448
    user_tokens: int = 64
    zipf: float = 1.1  # popularity of the system prompts: a few are most of the traffic

    def sampler(self, rng: random.Random):
        systems = [tuple(rng.randrange(32000) for _ in range(self.system_tokens)) for _ in range(self.system_prompts)]
        weights = [1.0 / (i + 1) ** self.zipf for i in range(self.system_prompts)]

        def prompt() -> tuple[int, ...]:
            system = rng.choices(systems, weights)[0]
            return system + tuple(rng.randrange(32000) for _ in range(self.user_tokens))

        return prompt


class _Recorder:
    """The token sink of every request (the client's receive thread calls `put`)."""

    def __init__(self, client: TandemClient):
        self._client = client
        self.first: dict[str, float] = {}
        self.inside: dict[str, float] = {}  # the prefill worker's own received -> first token seconds
        self.done: dict[str, float] = {}
        self.failed: dict[str, str] = {}

    def put(self, delta) -> None:
        rid = delta.attempt.request_id
        now = time.perf_counter()
        if delta.offset == 0 and rid not in self.first:
            self.first[rid] = now
            times = delta.times
            if times is not None and times.received is not None and times.first_token is not None:
                self.inside[rid] = times.first_token - times.received
        if delta.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
            self.done[rid] = now
            self._client.forget(rid)
        elif delta.status.is_finished():
            self.failed[rid] = delta.error or delta.status.name
            self._client.forget(rid)


async def _drive(client: TandemClient, rate: float, seconds: float, prompt, max_tokens: int, rng: random.Random,
                 recorder: _Recorder, arrivals: dict[str, float], answered: dict[str, float],
                 rejected: dict[str, str]) -> None:
    loop = asyncio.get_running_loop()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tasks = []

    async def one(request) -> None:
        try:
            await client.asubmit(request, recorder, timeout_s=60.0)
            answered[request.request_id] = time.perf_counter()
        except AdmissionRejected as exc:
            rejected[request.request_id] = exc.reason
            answered[request.request_id] = time.perf_counter()
        except Exception as exc:  # counted, never fatal: the point is how the control plane holds up
            rejected[request.request_id] = f"{type(exc).__name__}: {exc}"

    end = loop.time() + seconds
    next_at = loop.time()
    while True:
        next_at += rng.expovariate(rate)
        if next_at >= end:
            break
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        request = client.request(list(prompt()), params)
        arrivals[request.request_id] = time.perf_counter()
        tasks.append(loop.create_task(one(request)))
    await asyncio.gather(*tasks)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _control_stats(fleet: Fleet, reset: bool = False) -> list[ControlPlaneStats]:
    return ray.get([s.control_stats.remote(reset=reset) for s in fleet.schedulers], timeout=30)


def run_point(num_workers: int, rate: float, duration_s: float, per_host: int, spec: SimSpec, mix: PromptMix,
              max_tokens: int, shards: int = 1, seed: int = 0) -> dict:
    fleet = Fleet.start(num_workers, per_host, spec, shards=shards)
    client = TandemClient(fleet.schedulers, audit_s=3600.0)
    try:
        rng = random.Random(seed)
        prompt = mix.sampler(rng)
        recorder = _Recorder(client)
        warm_arrivals: dict[str, float] = {}
        asyncio.run(_drive(client, rate, WARMUP_S, prompt, max_tokens, rng, recorder, warm_arrivals, {}, {}))
        _control_stats(fleet, reset=True)
        arrivals: dict[str, float] = {}
        answered: dict[str, float] = {}
        rejected: dict[str, str] = {}
        cpu0, wall0 = time.process_time(), time.perf_counter()
        asyncio.run(_drive(client, rate, duration_s, prompt, max_tokens, rng, recorder, arrivals, answered, rejected))
        driver_cpu, driver_wall = time.process_time() - cpu0, time.perf_counter() - wall0
        shard_stats = _control_stats(fleet)
        stats = shard_stats[0] if shards == 1 else _merged(shard_stats)
        drain_until = time.monotonic() + DRAIN_S
        admitted = [r for r in arrivals if r not in rejected]
        while time.monotonic() < drain_until and any(r not in recorder.done and r not in recorder.failed
                                                      for r in admitted):
            time.sleep(0.1)
        hosts = fleet.check_integrity()
        hung = [r for r in admitted if r not in recorder.done and r not in recorder.failed]
        ttft = [recorder.first[r] - arrivals[r] for r in admitted if r in recorder.first]
        outside = [recorder.first[r] - arrivals[r] - recorder.inside[r] for r in admitted
                   if r in recorder.first and r in recorder.inside]
        submit = [answered[r] - arrivals[r] for r in admitted if r in answered]
        refusal = [answered[r] - arrivals[r] for r in rejected if r in answered]
        return {
            "workers": num_workers, "per_host": per_host, "shards": shards, "offered_rate": rate,
            "arrived": len(arrivals), "arrived_per_s": len(arrivals) / driver_wall,
            "admitted": stats.admitted, "admitted_per_s": stats.admitted / stats.wall_s,
            "rejected": len(rejected), "rejections": sorted(set(rejected.values()))[:5],
            "finished": sum(1 for r in admitted if r in recorder.done),
            "failed": sum(1 for r in admitted if r in recorder.failed), "hung": len(hung),
            "decision_p50_ms": _ms(stats.decision_p50_s), "decision_p99_ms": _ms(stats.decision_p99_s),
            "decision_max_ms": _ms(stats.decision_max_s),
            "submit_rtt_p50_ms": _ms(_pct(submit, 0.5)), "submit_rtt_p99_ms": _ms(_pct(submit, 0.99)),
            "refusal_rtt_p50_ms": _ms(_pct(refusal, 0.5)), "refusal_rtt_p99_ms": _ms(_pct(refusal, 0.99)),
            "refusal_decision_p50_ms": _ms(stats.refusal_p50_s), "refusal_decision_p99_ms": _ms(stats.refusal_p99_s),
            "scheduler_cpu_us_per_admission": stats.cpu_s / max(stats.admitted, 1) * 1e6,
            "ttft_p50_ms": _ms(_pct(ttft, 0.5)), "ttft_p99_ms": _ms(_pct(ttft, 0.99)),
            "outside_workers_p50_ms": _ms(_pct(outside, 0.5)), "outside_workers_p99_ms": _ms(_pct(outside, 0.99)),
            "scheduler_cpu_fraction": stats.cpu_s / stats.wall_s, "scheduler_max_rss_mb": stats.max_rss_bytes / 2**20,
            "prefix_index_entries": stats.prefix_index_entries, "in_flight_at_end": stats.in_flight,
            "worker_calls_per_admission": stats.worker_calls / max(stats.admitted, 1),
            "worker_commands_per_call": stats.worker_commands / max(stats.worker_calls, 1),
            "driver_cpu_fraction": driver_cpu / driver_wall,
            "host_step_late_s": sum(h["late_s"] for h in hosts), "host_steps": sum(h["steps"] for h in hosts),
            "host_failed_steps": sum(h["failed_steps"] for h in hosts),
            "per_shard": [{"admitted": st.admitted, "decision_p50_ms": _ms(st.decision_p50_s),
                           "decision_p99_ms": _ms(st.decision_p99_s), "cpu_fraction": st.cpu_s / st.wall_s}
                          for st in shard_stats] if shards > 1 else None,
        }
    finally:
        client.close()
        fleet.shutdown()


def _merged(stats: list[ControlPlaneStats]) -> ControlPlaneStats:
    """The shards as one: counts and CPU summed, each percentile the worst shard's (a bound, not a merge)."""
    def worst(name: str) -> float | None:
        values = [getattr(s, name) for s in stats if getattr(s, name) is not None]
        return max(values) if values else None

    wall = max(s.wall_s for s in stats)
    return ControlPlaneStats(
        sum(s.admitted for s in stats), worst("decision_p50_s"), worst("decision_p99_s"), worst("decision_max_s"),
        sum(s.cpu_s for s in stats), wall, max(s.max_rss_bytes for s in stats), sum(s.in_flight for s in stats),
        sum(s.prefix_index_entries for s in stats), sum(s.workers for s in stats),
        sum(s.worker_calls for s in stats), sum(s.worker_commands for s in stats), sum(s.refused for s in stats),
        worst("refusal_p50_s"), worst("refusal_p99_s"))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def bench(args: argparse.Namespace) -> dict:
    owns_ray = not ray.is_initialized()
    if owns_ray:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", num_cpus=64, include_dashboard=False, log_to_driver=False)
    spec = SimSpec(step_s=args.step_ms / 1000, prefill_tokens_per_step=args.prefill_tokens_per_step)
    mix = PromptMix()
    points = []
    try:
        for n in _ints(args.workers):
            for rate in _floats(args.rate):
                point = run_point(n, rate, args.duration, args.per_host, spec, mix, args.max_tokens, args.shards)
                points.append(point)
                print(_point_line(point), flush=True)
    finally:
        if owns_ray:
            ray.shutdown()
    return {"cores": os.cpu_count(), "step_s": spec.step_s, "duration_s": args.duration, "max_tokens": args.max_tokens,
            "prompt_mix": dataclasses.asdict(mix), "points": points}


def _point_line(p: dict) -> str:
    return (f"{p['workers']} workers, offered {p['offered_rate']:.0f}/s: admitted {p['admitted_per_s']:.0f}/s, "
            f"decision p50 {p['decision_p50_ms']} ms p99 {p['decision_p99_ms']} ms, outside workers p50 "
            f"{p['outside_workers_p50_ms']} ms, scheduler CPU {p['scheduler_cpu_fraction']:.0%} "
            f"({p['scheduler_cpu_us_per_admission']:.0f} us per admission), driver CPU {p['driver_cpu_fraction']:.0%}, "
            f"rejected {p['rejected']} (decided p50 {p['refusal_decision_p50_ms']} ms p99 {p['refusal_decision_p99_ms']} "
            f"ms, answered p50 {p['refusal_rtt_p50_ms']} ms p99 {p['refusal_rtt_p99_ms']} ms), "
            f"hung {p['hung']}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",")]


def _floats(text: str) -> list[float]:
    return [float(x) for x in str(text).split(",")]


def main(args: argparse.Namespace) -> int:
    import json

    out = out_path("control-plane", args.out)
    report = bench(args)
    write_json(out, report)
    plots = decision_plots(report["points"], out)
    if args.json:
        print(json.dumps(report, indent=1))
    best = max(report["points"], key=lambda p: p["workers"])
    text = (f"at {best['workers']} workers, {best['admitted_per_s']:.0f} admissions/s, decision p99 "
            f"{best['decision_p99_ms']} ms, {sum(p['hung'] for p in report['points'])} hung")
    print(summary_line("control-plane", text, out, plots), flush=True)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="64", help="simulated workers (half prefill, half decode); a comma list sweeps")
    p.add_argument("--rate", default="1000", help="offered requests per second (Poisson); a comma list sweeps")
    p.add_argument("--duration", type=float, default=10.0, help="seconds measured per point (after a 2 s warm-up)")
    p.add_argument("--per-host", type=int, default=64, help="simulated workers per process")
    p.add_argument("--shards", type=int, default=1,
                   help="scheduler actors, each with its share of the workers; the client picks by prompt prefix")
    p.add_argument("--step-ms", type=float, default=20.0, help="a simulated worker's step time")
    p.add_argument("--prefill-tokens-per-step", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    p.add_argument("--json", action="store_true", help="also print the JSON report")
    add_out_argument(p, "control-plane", "with several points, decision-time PNGs beside it")
    p.set_defaults(func=main, smoke={"workers": "4", "rate": "50", "duration": 2.0, "per_host": 2})
