"""`tandem bench compare` on the tiny model: 2 colocated workers vs 1P+1D, each started as a `tandem serve`
subprocess, the same trace sent to both, and both stopped afterwards."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from experiments.compare.layouts import parse_layouts
from experiments.compare.server import ServeProcess, port_is_free, session_pids
from cluster.control.autoscale.profile import EngineLimits, EngineProfile, LinearCost, ModelShape
from tandem.cli import main
from tests.helpers.bench import check_run

pytestmark = pytest.mark.slow  # starts a server per layout and runs a trace on each


def _schedule(run: dict) -> list[tuple]:
    return [(r["index"], r["warmup"], r["scheduled_s"], r["prompt_len"], r["max_tokens"]) for r in run["requests"]]


def _tiny_profile(path):
    """A hand-written linear profile of the tiny model's order of magnitude (measuring one takes ~10 s)."""
    model = ModelShape("tiny-llama", num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=384, vocab_size=2048, dtype_bytes=4)
    cost = LinearCost(2e-3, 2e-5, 1e-9, 2e-3, 1e-4, 1e-7)
    EngineProfile("hand-written", "test", model, cost, EngineLimits(), 1e9, 1e-3).save(path)
    return path


def test_compare_two_layouts_on_one_trace(tmp_path, capsys):
    out = tmp_path / "compare.json"
    profile = _tiny_profile(tmp_path / "profile.json")
    code = main(["bench", "compare", "--model", "builtin:tiny-llama", "--layouts", "2C,1P:1D",
                 "--prompt-len", "uniform:32:160", "--output-len", "uniform:4:12", "--rate", "4", "--duration", "3",
                 "--warmup", "1", "--slo-ttft-ms", "3000", "--slo-tpot-ms", "500", "--cooldown", "0",
                 "--profile", str(profile), "--out", str(out), "--no-progress"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["compare"] and data["layouts"] == ["2C", "1P:1D"]
    assert data["machine"]["cpu_count"] >= 1 and len(data["machine"]["load_avg_start"]) == 3
    assert data["resources_per_worker"] == {"num_cpus": 1.0, "torch_threads": 1}
    colocated, disagg = data["runs"]
    assert colocated["config"]["mode"] == "colocated" and colocated["config"]["colocated"]["replicas"] == 2
    assert disagg["config"]["mode"] == "disaggregated"
    assert (disagg["config"]["prefill"]["replicas"], disagg["config"]["decode"]["replicas"]) == (1, 1)
    for entry in data["runs"]:
        for pool in ("prefill", "decode", "colocated"):
            assert entry["config"][pool]["num_cpus"] == 1.0 and entry["config"][pool]["torch_threads"] == 1
        run = entry["result"]
        check_run(run)
        assert run["counts"]["failed"] == 0, run["failures"]
        assert run["warmup"]["counts"]["sent"] == 1
        assert run["output_len_mismatches"] == 0
        # Stopped completely: the serve process exited on its own, nothing left in its session, port free.
        server = entry["server"]
        assert server["returncode"] == 0 and server["leftover_pids"] == [] and server["port_free"]
        port = int(run["spec"]["base_url"].rsplit(":", 1)[1])
        assert port_is_free("127.0.0.1", port)
        # The planner's prediction of the same trace sits next to the measurement.
        v = run["validation"]
        assert v["goodput_rps"]["measured"] == run["slo"]["goodput_rps"]
        assert v["goodput_rps"]["predicted"] is not None and v["ttft_p90_ms"]["predicted"] > 0
    # Re-scoring at the SLOs of the run reproduces the measured goodput; 9 pairs of scaled SLOs in all.
    grid = data["slo_sensitivity"]
    assert len(grid) == 9
    (same,) = [row for row in grid if (row["ttft_ms"], row["tpot_ms"]) == (3000, 500)]
    assert same["goodput_rps"] == {e["layout"]: e["result"]["slo"]["goodput_rps"] for e in data["runs"]}
    # The same requests at the same scheduled times, with the same prompt contents (one salt).
    assert _schedule(colocated["result"]) == _schedule(disagg["result"])
    assert colocated["result"]["spec"]["workload"]["prompt_salt"] == disagg["result"]["spec"]["workload"]["prompt_salt"]
    assert colocated["result"]["spec"]["base_url"] != disagg["result"]["spec"]["base_url"]
    for name in ("compare_bars.png", "compare_cdf.png", "compare_timeline_2C.png", "compare_timeline_1P1D.png",
                 "layout-2C.yaml", "layout-1P1D.yaml"):
        assert (tmp_path / name).stat().st_size > 0, name
    table = capsys.readouterr().out
    assert "1P:1D vs 2C" in table and "p99 ITL" in table


def test_layouts_must_have_equal_workers():
    assert [layout.describe() for layout in parse_layouts("4C, 1P:3D,2p:2d,3P:1D")] == ["4C", "1P:3D", "2P:2D", "3P:1D"]
    for bad, words in (("2C,1P:2D", "same number of workers"), ("2X", "bad layout"), ("2C,2C", "repeats")):
        try:
            parse_layouts(bad)
        except ValueError as exc:
            assert words in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_session_pids_sees_only_live_members():
    import os

    assert os.getpid() in session_pids(os.getsid(0))
    assert session_pids(2**22 + 12345) == []


def test_simulated_lease_expiry_fails_late_handoffs():
    """A decode reservation lives `lease_s` from admission; KV landing later fails the request (no token),
    as on the real decode worker, and its reservation is given back."""
    from experiments.capacity.metrics import SLO, summarize
    from experiments.capacity.simulator import Layout, SimOptions, simulate
    from experiments.capacity.workload import SimRequest

    model = ModelShape("m", num_layers=1, hidden_size=8, num_heads=1, num_kv_heads=1, head_dim=8,
                       intermediate_size=8, vocab_size=16, dtype_bytes=4)
    # 1 s per prefill step of 100 tokens; decode steps of 10 ms; instant transfer.
    profile = EngineProfile("synthetic", "test", model, LinearCost(0.0, 0.01, 0.0, 0.01, 0.0, 0.0),
                            EngineLimits(16, 1000, 8, 100), 1e12, 0.0)
    requests = [SimRequest(0.0, 100, 3) for _ in range(3)]  # prefills end at 1, 2 and 3 s
    result = simulate(profile, Layout.disaggregated(1, 1), requests, SimOptions(local_prefill=False, lease_s=2.5))
    assert [s.rejected is None for s in result.seqs] == [True, True, False]
    assert result.seqs[2].first_token_s is None and result.seqs[2].finish_s is None
    assert result.seqs[1].first_token_s == 2.0
    summary = summarize(result, SLO(ttft_s=10.0))
    assert (summary.completed, summary.rejected, summary.attainment) == (2, 1, 2 / 3)
    no_lease = simulate(profile, Layout.disaggregated(1, 1), requests, SimOptions(local_prefill=False))
    assert all(s.rejected is None and s.finish_s is not None for s in no_lease.seqs)


def test_a_server_that_loses_its_port_starts_on_another(tmp_path):
    """The port chosen for a layout can be taken before the server binds it (Ray's connections use the same
    range): the server starts again on a fresh port instead of failing the comparison."""
    config = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        server = ServeProcess(config, "127.0.0.1", taken, tmp_path / "serve.log", expected_workers=2)
        try:
            server.start(timeout_s=180)
            assert server.port != taken and server.url.endswith(f":{server.port}")
        finally:
            stopped = server.stop()
    assert stopped["returncode"] == 0 and stopped["leftover_pids"] == [] and stopped["port_free"]
