"""Run a function on every rank of a tensor-parallel group in this machine: one process per rank, joined
by torch.distributed over gloo (as a CPU worker's ranks are), without Ray. Rank 0's return value comes
back. `tandem bench engine --tp N` and the tensor-parallel tests use it."""

from __future__ import annotations

import pickle
import socket
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, threads: int, timeout_s: float, fn, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        out = fn(rank, size, *args)
        dist.destroy_process_group()
        # Plain pickle bytes: a tensor sent as itself would live in this process's shared memory, gone
        # once it exits.
        results.put((rank, pickle.dumps(out), None))
    except BaseException:  # reported to the test, which fails with the rank's traceback
        results.put((rank, None, traceback.format_exc()))


def run_ranks(size: int, fn, *args, timeout_s: float = 300.0, threads: int = 1, collective_timeout_s: float = 600.0):
    """`fn(rank, size, *args)` on `size` processes of `threads` torch threads each; returns rank 0's
    result. `fn` must be importable (a module-level function); a collective waits `collective_timeout_s`."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, threads, collective_timeout_s, fn, args, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    outs = {}
    try:
        for _ in range(size):
            rank, out, error = results.get(timeout=timeout_s)
            if error:
                raise AssertionError(f"rank {rank} failed:\n{error}")
            outs[rank] = pickle.loads(out)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return outs[0]
