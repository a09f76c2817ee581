"""`experiments/bench_step_budget.py` runs end to end at toy sizes on the tiny model and prints each point,
with the budget binding (a budget no step meets) in the mixed point."""

from __future__ import annotations

import re

from experiments.bench_step_budget import main


def test_the_bench_prints_both_points_and_their_ratios(hf_models, capsys):
    main(["--model", str(hf_models["llama"]), "--budget-ms", "0.001", "--decodes", "3", "--long", "100",
          "--clients", "2", "--requests", "3", "--prompt", "40", "--out", "4"])
    out = capsys.readouterr().out
    steps = {name: int(n) for name, n in re.findall(r"mixed (\S+) +3 decodes \+ 100-token prompt: steps with decodes (\d+)", out)}
    assert steps["none"] == 1  # the whole prompt in one step beside the decodes
    assert steps["0.001ms"] == 4  # 32 tokens a step (MIN_PREFILL_TOKENS): 32 + 32 + 32 + 4
    assert re.search(r"loop  0\.001ms +2 clients x 40 in / 4 out, 3 requests: TPOT p50 \d+ ms", out), out
    assert "mixed 0.001ms/none: step max" in out and "loop  0.001ms/none: TPOT p50" in out, out


def test_the_open_loop_runs_every_request(hf_models, capsys):
    main(["--model", str(hf_models["llama"]), "--skip", "mixed", "--rate", "200", "--requests", "4", "--prompt", "40",
          "--out", "4"])
    out = capsys.readouterr().out
    assert re.search(r"loop  none +200 req/s x 40 in / 4 out, 4 requests: TPOT p50 \d+ ms", out), out
    assert re.search(r"loop  100ms +200 req/s x 40 in / 4 out, 4 requests: TPOT p50 \d+ ms", out), out
