"""`experiments/bench_worker_threads.py` runs end to end at toy sizes on the tiny model: a row per role and
per state of the other core, and the stand-in for the other role ends with the bench."""

from __future__ import annotations

import multiprocessing as mp
import re

from experiments.bench_worker_threads import main


def test_the_bench_prints_a_row_per_step_and_other_core(hf_models, capsys):
    main(["--model", str(hf_models["llama"]), "--decodes", "2", "--context", "16", "--prompt", "16", "--reps", "1"])
    out = capsys.readouterr().out
    rows = re.findall(r"other core (idle|busy): (decode|prefill) step 1 thread [\d.]+ ms, 2 threads [\d.]+ ms", out)
    assert rows == [("idle", "decode"), ("idle", "prefill"), ("busy", "decode"), ("busy", "prefill")], out
    assert re.search(r"torch.set_num_threads: [\d.]+ us a call", out), out
    assert not mp.active_children()
