"""`tandem bench serve` against a live 1P+1D tandem cluster behind its HTTP ingress."""

from __future__ import annotations

import json

import pytest

from tandem.cli import main
from tests.helpers.bench import check_run
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import serving


@pytest.fixture(scope="module")
def server(ray_session):
    with serving(load("local.yaml")) as live:
        yield live


def test_bench_serve_against_tandem(server, tmp_path, capsys):
    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server[1], "--rate", "4", "--duration", "3", "--warmup", "2",
                 "--prompt-len", "uniform:16:96", "--output-len", "uniform:4:12", "--slo-ttft-ms", "2000",
                 "--slo-tpot-ms", "500", "--out", str(out), "--no-progress"])
    assert code == 0
    run = json.loads(out.read_text())
    check_run(run)
    assert run["model"] == "tiny-llama" and run["loop"] == "open"
    assert run["warmup"]["counts"]["sent"] == 2
    assert len(run["requests"]) == 2 + run["counts"]["sent"]
    assert run["counts"]["failed"] == 0, run["failures"]
    # ignore_eos + max_tokens: the server returned exactly the lengths the workload asked for.
    assert run["output_len_mismatches"] == 0
    for r in run["requests"]:
        assert r["output_tokens"] == r["max_tokens"] and r["prompt_tokens"] == r["prompt_len"]
    assert (tmp_path / "serve_cdf.png").stat().st_size > 0 and (tmp_path / "serve_timeline.png").stat().st_size > 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "attainment" in table and "client lag" in table
    wait_until_idle(server[0])


def test_bench_serve_sweep_and_shared_prefixes_against_tandem(server, tmp_path):
    out = tmp_path / "sweep.json"
    code = main(["bench", "serve", "--base-url", server[1], "--rates", "2,6", "--num-requests", "6",
                 "--shared-prefixes", "2", "--prefix-len", "64", "--prompt-len", "20", "--output-len", "6",
                 "--slo-ttft-ms", "2000", "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["rates"] == [2.0, 6.0] and len(data["runs"]) == 2
    for run in data["runs"]:
        check_run(run)
        assert run["counts"]["sent"] == 6
        done = [r for r in run["requests"] if r["error"] is None]
        assert all(r["prompt_tokens"] == 84 for r in done)
        # Only the shared 64-token prefixes hit the cache, also in the second run (a fresh prompt salt).
        assert all(r["cached_tokens"] <= 64 for r in done)
        assert run["cached_prompt_fraction"] <= 64 / 84
    passing = [rate for rate, a in zip(data["rates"], data["attainment"]) if a >= 0.9]
    assert data["best_rate"] == (max(passing) if passing else None)
    for suffix in ("attainment", "cdf", "timeline"):
        assert (tmp_path / f"sweep_{suffix}.png").stat().st_size > 0
    wait_until_idle(server[0])
