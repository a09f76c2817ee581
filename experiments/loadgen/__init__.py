"""`tandem bench serve`: an open-loop load generator for OpenAI-compatible streaming completions.

In-process use: `run_benchmark(BenchSpec(...)) -> BenchResult` (`.summary`, `.to_dict()`, `.save()`),
`sweep(spec, rates=None) -> SweepResult`, and `experiments.loadgen.plots.write_plots(result_dict, json_path)`.

Modules: spec (what a run is), workload (requests by index), arrivals (schedules), http_client (one
timed streaming request), runner (open/closed loop), metrics (records -> numbers), sweep (rate
search), report (terminal tables), plots (PNGs), progress (stderr bar), cli (argparse).
"""

from experiments.loadgen.runner import BenchResult, run_benchmark, run_benchmark_async
from experiments.loadgen.spec import ArrivalSpec, BenchSpec, LengthDist, WorkloadSpec
from experiments.loadgen.sweep import SweepResult, sweep

__all__ = ["ArrivalSpec", "BenchResult", "BenchSpec", "LengthDist", "SweepResult", "WorkloadSpec", "run_benchmark",
           "run_benchmark_async", "sweep"]
