"""`tandem bench chaos` judges its run by the README's chaos claim and exits 1 when the run broke it (the
run itself: tests/cluster/control/test_crash_loop_chaos.py); the other benches keep exiting 0."""

from __future__ import annotations

import argparse
import json

from experiments.bench_chaos import verdict
from experiments.bench_report import report_main


def _run(**changed) -> dict:
    """A report as `bench_chaos.bench` writes it, of a run that kept the claim."""
    held = {"requests": 240, "exact": 239, "exact_fraction": 239 / 240, "wrong": 0, "hung": 0,
            "longest_silence_s": 59.5, "progress_timeout_s": 60.0, "kv_blocks_after": 0, "in_flight_after": 0,
            "kills_restarting": 82, "min_restarting_kills": 0, "max_seconds": 1800.0}
    return {**held, **changed}


def test_a_run_that_kept_the_claim_breaks_nothing():
    assert verdict(_run()) == []


def test_each_part_of_the_claim_is_judged():
    assert verdict(_run(exact=237, exact_fraction=237 / 240)) == ["237/240 streams exact: under 99%"]
    assert verdict(_run(wrong=1)) == ["1 streams with wrong text"]
    assert verdict(_run(hung=1)) == ["1 streams hung"]
    assert verdict(_run(longest_silence_s=60.0)) == ["a stream was silent 60.0 s: not under the 60.0 s bound"]
    assert verdict(_run(kv_blocks_after=3)) == ["3 KV blocks held and 0 requests in flight after the load"]
    assert verdict(_run(in_flight_after=1)) == ["0 KV blocks held and 1 requests in flight after the load"]
    assert verdict(_run(min_restarting_kills=5, kills_restarting=4)) == [
        "4 SIGKILLs of restarting processes within 1800.0 s, not the 5 asked for"]


def test_below_100_streams_one_clean_error_is_not_judged_a_broken_fraction():
    """1% of 6 streams is less than one: the claim allows the clean error such a run may meet."""
    assert verdict(_run(requests=6, exact=5, exact_fraction=5 / 6)) == []
    assert verdict(_run(requests=6, exact=5, exact_fraction=5 / 6, wrong=1)) == ["1 streams with wrong text"]


def test_the_command_exits_1_when_its_verdict_finds_something_broken(tmp_path, capsys):
    args = argparse.Namespace(out=str(tmp_path / "run.json"))
    assert report_main("chaos", lambda a: _run(), lambda r: "held", verdict)(args) == 0
    assert json.loads((tmp_path / "run.json").read_text())["broken"] == []
    assert report_main("chaos", lambda a: _run(hung=2), lambda r: "hung", verdict)(args) == 1
    assert json.loads((tmp_path / "run.json").read_text())["broken"] == ["2 streams hung"]
    assert "tandem bench chaos: broken: 2 streams hung" in capsys.readouterr().err
    # A bench without a verdict exits 0 whatever its numbers, and its report gains no field.
    assert report_main("cluster", lambda a: {"x": 1}, lambda r: "x")(args) == 0
    assert json.loads((tmp_path / "run.json").read_text()) == {"x": 1}
