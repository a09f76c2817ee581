"""The load generator against a small real HTTP server written here, which speaks streaming completions
and misbehaves on request: it stalls, refuses, cuts streams and splits events across writes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tandem.cli import main
from experiments.loadgen.report import format_run
from experiments.loadgen.runner import run_benchmark
from experiments.loadgen.spec import ArrivalSpec, BenchSpec, LengthDist, WorkloadSpec
from experiments.loadgen.sweep import _search, sweep
from experiments.loadgen.workload import build_workload

STALL_S = 1.0


def fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        if prompt == "busy":
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if prompt == "stall":
            time.sleep(STALL_S)  # blocks the event loop: the whole server stalls, as a GC pause would

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if prompt == "slow":
                    await asyncio.sleep(2.0)
                for i in range(n):
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                    event = f"data: {json.dumps(chunk)}\n\n"
                    if prompt == "split":  # an event across two writes, with CRLF line ends
                        event = event.replace("\n", "\r\n")
                        yield event[:7]
                        await asyncio.sleep(0.01)
                        yield event[7:]
                    else:
                        yield event
                    await asyncio.sleep(0.005)
                    if prompt == "cut":
                        return  # no usage, no [DONE]
                yield f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 3, 'completion_tokens': n}})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake():
    state = {"in_flight": 0, "max_in_flight": 0}
    server = uvicorn.Server(uvicorn.Config(fake_app(state), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", state
    server.should_exit = True
    thread.join(timeout=5)


def trace(tmp_path, prompts: list[str], gap_s: float, output_len: int = 3) -> WorkloadSpec:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i * gap_s, "prompt": p, "output_len": output_len}) + "\n"
                            for i, p in enumerate(prompts)))
    return WorkloadSpec(kind="trace", trace_path=str(path))


def test_ttft_of_requests_scheduled_during_a_stall_includes_their_wait(fake, tmp_path):
    prompts = ["go"] * 20
    prompts[4] = "stall"  # scheduled at 0.4 s; the server then stalls for 1 s
    spec = BenchSpec(base_url=fake[0], workload=trace(tmp_path, prompts, 0.1), arrival=ArrivalSpec(kind="trace"),
                     request_timeout_s=10, progress=False)
    result = run_benchmark(spec)
    assert result.summary["counts"] == {"sent": 20, "completed": 20, "failed": 0}
    stall = result.records[4]
    assert stall.ttft >= STALL_S
    # The stall began when the server read request 4, which is no earlier than its scheduled time, so
    # no token left the server before stall.scheduled + STALL_S. A request scheduled during the stall
    # must have waited at least the rest of it, and TTFT counted from its schedule has to show that.
    during = [r for r in result.records if stall.scheduled < r.scheduled < stall.scheduled + STALL_S - 1e-6]
    assert len(during) >= 8
    for r in during:
        assert r.ttft >= stall.scheduled + STALL_S - r.scheduled, (r.index, r.scheduled, r.ttft)
    # A request 0.2 s into the stall waited ~0.8 s: what a client timing from the response would miss.
    assert result.records[6].ttft >= 0.79


def test_failures_by_type_and_split_events(fake, tmp_path):
    spec = BenchSpec(base_url=fake[0] + "/v1", workload=trace(tmp_path, ["go", "busy", "cut", "split", "slow"], 0.02),
                     arrival=ArrivalSpec(kind="trace"), request_timeout_s=0.6, progress=False)
    result = run_benchmark(spec)
    assert result.model == "fake-model"  # asked /v1/models
    by_index = {r.index: r for r in result.records}
    assert [by_index[i].error for i in range(5)] == [None, "http_503", "stream_error", None, "timeout"]
    assert "overloaded" in by_index[1].error_detail and "[DONE]" in by_index[2].error_detail
    assert len(by_index[3].emits) == 3 and by_index[3].output_tokens == 3
    s = result.summary
    assert s["counts"] == {"sent": 5, "completed": 2, "failed": 3}
    assert s["failures"] == {"http_503": 1, "stream_error": 1, "timeout": 1}
    assert s["slo"]["attainment"] == pytest.approx(2 / 5)


def test_connection_failures_are_counted():
    spec = BenchSpec(base_url="http://127.0.0.1:9", model="m", arrival=ArrivalSpec(kind="constant", rate=50.0),
                     num_requests=3, request_timeout_s=5, progress=False)
    s = run_benchmark(spec).summary
    assert s["counts"] == {"sent": 3, "completed": 0, "failed": 3} and s["failures"] == {"connection": 3}
    assert s["slo"]["attainment"] == 0.0 and s["throughput"]["requests_per_s"] == 0.0


def test_closed_loop_keeps_its_concurrency_and_says_so(fake):
    fake[1]["max_in_flight"] = 0
    spec = BenchSpec(base_url=fake[0], arrival=ArrivalSpec(kind="closed", concurrency=2), num_requests=6, warmup=1,
                     workload=WorkloadSpec(prompt_len=LengthDist.parse("5"), output_len=LengthDist.parse("4")),
                     progress=False)
    result = run_benchmark(spec)
    s = result.summary
    assert s["loop"] == "closed" and "closed loop" in s["arrival"]
    assert s["counts"]["sent"] == 6 and s["warmup"]["counts"]["sent"] == 1
    assert [r.index for r in result.records] == list(range(7))
    assert 1 <= fake[1]["max_in_flight"] <= 2
    assert all(r.output_tokens == 4 for r in result.records)
    assert "note: closed loop" in format_run(result.to_dict())


def test_sweep_over_given_rates_and_its_plots(fake, tmp_path):
    from experiments.loadgen.plots import write_plots

    spec = BenchSpec(base_url=fake[0], arrival=ArrivalSpec(kind="poisson", rate=1.0), num_requests=4,
                     workload=WorkloadSpec(prompt_len=LengthDist.parse("5"), output_len=LengthDist.parse("3")),
                     slo_ttft_ms=5000, progress=False)
    result = sweep(spec, [40.0, 20.0])
    data = result.to_dict()
    assert data["rates"] == [20.0, 40.0] and data["best_rate"] == 40.0
    assert all(run["counts"]["sent"] == 4 for run in data["runs"])
    # The same lengths at every rate (seeded by request index), fresh contents (a salt per step, recorded).
    salts = [run["spec"]["workload"]["prompt_salt"] for run in data["runs"]]
    assert salts[1] == salts[0] + 1
    again = [build_workload(WorkloadSpec(**run["spec"]["workload"])) for run in data["runs"]]
    assert [r.prompt_len for r in result.runs[0].records] == [again[1].request(i).prompt_len for i in range(4)]
    assert again[0].request(0).prompt != again[1].request(0).prompt
    paths = write_plots(data, tmp_path / "sweep.json")
    assert [p.name for p in paths] == ["sweep_attainment.png", "sweep_cdf.png", "sweep_timeline.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


def test_search_rises_geometrically_then_bisects():
    tried = []

    def run(rate):
        tried.append(rate)
        return rate <= 5.5

    _search(1.0, 2.0, 8, 2, run)
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]
    assert tried[4:] == pytest.approx([32 ** 0.5, (4 * 32 ** 0.5) ** 0.5])
    with pytest.raises(ValueError, match="closed-loop"):
        sweep(BenchSpec(base_url="http://x", arrival=ArrivalSpec(kind="closed", concurrency=1), num_requests=1))


def test_cli_errors_name_the_problem(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--rate", "1"]) == 2
    assert "--num-requests N or --duration S" in capsys.readouterr().err
    assert main(["bench", "serve", "--concurrency", "2", "--rate", "1", "--num-requests", "1"]) == 2
    assert "closed loop" in capsys.readouterr().err
    assert main(["bench", "serve", "--rates", "1,x", "--num-requests", "1"]) == 2
    assert "--rates wants numbers" in capsys.readouterr().err
