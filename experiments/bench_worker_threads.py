"""Whether a 1P+1D pair on two cores gains from a worker raising its torch threads while the other role is
idle: one worker's step (a decode step of `--decodes` sequences at `--context` tokens, a `--prompt`-token
prefill) at 1 and 2 threads, with the other core idle and with a process standing in for the other role
(one thread of back-to-back matmuls, as a busy worker runs); and what switching threads costs
(`torch.set_num_threads` alone, and a 2-thread step right after a 1-thread one against steady 2).

Prints medians and ratios; run it on an otherwise idle machine with two cores (on a shared one a second
thread meets other processes, which is what the "busy" rows show anyway).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from actors.engine.config import EngineConfig
from actors.engine.model.default_model import resolve_model
from actors.engine.model.runner import ModelRunner

_BUSY_DEADLINE_S = 600.0  # the stand-in ends by itself even if this process dies first


def _busy(stop) -> None:
    torch.set_num_threads(1)
    a, w = torch.randn(256, 576), torch.randn(576, 1536)
    end = time.monotonic() + _BUSY_DEADLINE_S
    while not stop.is_set() and time.monotonic() < end:
        a @ w


def _inputs(decodes: int, context: int, prompt: int):
    tokens, q, c, tables = [], [], [], []
    block = 0
    for _ in range(decodes):
        n = (context + 1 + 15) // 16
        tokens.append(5), q.append(1), c.append(context), tables.append(list(range(block, block + n)))
        block += n
    if prompt:
        n = (prompt + 15) // 16
        tokens += [7] * prompt
        q.append(prompt), c.append(0), tables.append(list(range(block, block + n)))
    return tokens, q, c, tables, list(range(len(q)))


def _median_ms(runner, inputs, threads: int, reps: int, switch: bool = False) -> float:
    """The median step at `threads`; with `switch`, each timed step follows an untimed one at the other count."""
    times = []
    for _ in range(reps):
        if switch:
            torch.set_num_threads(3 - threads)
            runner.execute(*inputs)
        torch.set_num_threads(threads)
        start = time.perf_counter()
        runner.execute(*inputs)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    runner = ModelRunner.from_config(EngineConfig(model=resolve_model(args.model), num_kv_blocks=1024))
    n = 20000
    start = time.perf_counter()
    for i in range(n):
        torch.set_num_threads(1 + i % 2)
    print(f"torch.set_num_threads: {1e6 * (time.perf_counter() - start) / n:.2f} us a call")
    shapes = {"decode": _inputs(args.decodes, args.context, 0), "prefill": _inputs(0, 0, args.prompt)}
    ctx = mp.get_context("spawn")
    for other in ("idle", "busy"):
        stop = ctx.Event()
        proc = ctx.Process(target=_busy, args=(stop,), daemon=True) if other == "busy" else None
        if proc is not None:
            proc.start()
            time.sleep(1.0)  # its import and first matmuls
        try:
            for name, inputs in shapes.items():
                _median_ms(runner, inputs, 1, 2)  # warm
                one = _median_ms(runner, inputs, 1, args.reps)
                two = _median_ms(runner, inputs, 2, args.reps)
                switched = _median_ms(runner, inputs, 2, args.reps, switch=True)
                print(f"other core {other}: {name} step 1 thread {one:.1f} ms, 2 threads {two:.1f} ms "
                      f"({two / one:.2f}x), 2 threads right after a switch {switched:.1f} ms ({switched / two:.2f}x)",
                      flush=True)
        finally:
            stop.set()
            if proc is not None:  # (on a loaded box it may still be importing torch: stopped, then waited for)
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
    torch.set_num_threads(1)


if __name__ == "__main__":
    main()
