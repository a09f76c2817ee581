"""Workload generators and arrival schedules: exact counts, bounds and seeded reproducibility."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.loadgen.arrivals import open_loop_offsets, trace_offsets
from experiments.loadgen.runner import schedule
from experiments.loadgen.spec import ArrivalSpec, BenchSpec, LengthDist, WorkloadSpec
from experiments.loadgen.workload import FIRST_TOKEN_ID, build_workload, sample_length


def test_length_parse_forms_and_errors():
    assert LengthDist.parse("64") == LengthDist(kind="fixed", mean=64)
    assert LengthDist.parse("uniform:8:16") == LengthDist(kind="uniform", mean=12, low=8, high=16)
    assert LengthDist.parse("lognormal:200:50") == LengthDist(kind="lognormal", mean=200, std=50)
    for bad in ("", "x", "uniform:8", "gauss:1:2", "uniform:a:b"):
        with pytest.raises(ValueError, match="bad length"):
            LengthDist.parse(bad)
    with pytest.raises(ValueError, match="reversed"):
        LengthDist.parse("uniform:16:8")
    with pytest.raises(ValueError, match="positive std"):
        LengthDist.parse("lognormal:200:0")


def test_sampled_lengths_follow_their_distribution():
    rng = np.random.default_rng(0)
    assert {sample_length(LengthDist.parse("7"), rng) for _ in range(50)} == {7}
    uniform = [sample_length(LengthDist.parse("uniform:3:6"), rng) for _ in range(2000)]
    assert set(uniform) == {3, 4, 5, 6}
    logn = np.array([sample_length(LengthDist.parse("lognormal:200:50"), rng) for _ in range(20000)])
    assert abs(logn.mean() - 200) < 3 and abs(logn.std() - 50) < 3
    clipped = LengthDist(kind="lognormal", mean=200, std=100, low=150, high=220)
    values = [sample_length(clipped, rng) for _ in range(500)]
    assert min(values) == 150 and max(values) == 220


def test_synthetic_workload_is_seeded_per_request():
    spec = WorkloadSpec(prompt_len=LengthDist.parse("uniform:5:9"), output_len=LengthDist.parse("4"), vocab_size=50, seed=3)
    a, b = build_workload(spec), build_workload(spec)
    reqs = [a.request(i) for i in range(20)]
    assert reqs == [b.request(i) for i in range(20)]
    assert a.request(7) == reqs[7]  # by index, not by call order
    assert {r.output_len for r in reqs} == {4}
    assert all(5 <= r.prompt_len <= 9 for r in reqs)
    assert all(FIRST_TOKEN_ID <= t < 50 for r in reqs for t in r.prompt)
    other = build_workload(spec.model_copy(update={"seed": 4}))
    assert [other.request(i) for i in range(20)] != reqs
    # Another salt: the same lengths, other tokens (a repeated run must miss the server's prefix cache).
    salted = [build_workload(spec.model_copy(update={"prompt_salt": 1})).request(i) for i in range(20)]
    assert [(r.prompt_len, r.output_len) for r in salted] == [(r.prompt_len, r.output_len) for r in reqs]
    assert all(a.prompt != b.prompt for a, b in zip(salted, reqs))


def test_shared_prefix_workload_rotates_k_prefixes():
    spec = WorkloadSpec(kind="shared_prefix", num_prefixes=3, prefix_len=10, prompt_len=LengthDist.parse("4"),
                        output_len=LengthDist.parse("2"))
    w = build_workload(spec)
    reqs = [w.request(i) for i in range(12)]
    prefixes = [tuple(r.prompt[:10]) for r in reqs]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 4 for p in set(prefixes))
    assert all(prefixes[i] == tuple(w.prefixes[i % 3]) for i in range(12))
    assert all(r.prompt_len == 14 for r in reqs)
    assert len({tuple(r.prompt[10:]) for r in reqs}) == 12  # fresh suffixes
    salted = build_workload(spec.model_copy(update={"prompt_salt": 5}))
    assert not {tuple(p) for p in salted.prefixes} & {tuple(p) for p in w.prefixes}


def test_trace_workload_reads_all_prompt_forms(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0.5, "prompt": "hello", "output_len": 3},
            {"timestamp": 0.0, "prompt_len": 6, "output_len": 2},
            {"timestamp": 1.5, "prompt": [11, 12, 13], "output_len": 1}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    w = build_workload(WorkloadSpec(kind="trace", trace_path=str(path), vocab_size=40))
    assert w.natural_count == 3
    reqs = [w.request(i) for i in range(3)]
    assert [r.timestamp for r in reqs] == [0.0, 0.5, 1.5]
    assert reqs[0].prompt_len == 6 and all(FIRST_TOKEN_ID <= t < 40 for t in reqs[0].prompt)
    assert reqs[1].prompt == "hello" and reqs[1].prompt_len is None
    assert reqs[2].prompt == [11, 12, 13] and reqs[2].output_len == 1
    assert w.request(3) == reqs[0]  # repeats past the end


@pytest.mark.parametrize("line, message", [
    ("{not json", "t.jsonl:2: not JSON"),
    ('{"timestamp": 1, "output_len": 2}', "t.jsonl:2: give 'prompt'"),
    ('{"timestamp": 1, "prompt": "x", "output_len": 0}', "'output_len' must be"),
    ('{"timestamp": -1, "prompt": "x", "output_len": 1}', "'timestamp' must be"),
    ('{"timestamp": 1, "prompt": "x", "output_len": 1, "extra": 1}', r"unknown field\(s\) \['extra'\]"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "prompt": "ok", "output_len": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        build_workload(WorkloadSpec(kind="trace", trace_path=str(path)))


def _offsets(n: int, **arrival) -> np.ndarray:
    gen = open_loop_offsets(ArrivalSpec(**arrival))
    return np.array([next(gen) for _ in range(n)])


def test_open_loop_processes():
    assert _offsets(5, kind="constant", rate=4.0).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    poisson = np.diff(_offsets(20001, kind="poisson", rate=5.0, seed=1))
    assert abs(poisson.mean() - 0.2) < 0.01 and abs(poisson.std() / poisson.mean() - 1) < 0.03
    bursty = np.diff(_offsets(20001, kind="gamma", rate=5.0, burstiness=0.25, seed=1))
    assert abs(bursty.mean() - 0.2) < 0.015 and abs(bursty.std() / bursty.mean() - 2) < 0.1  # CV = 1/sqrt(k)
    assert _offsets(50, kind="poisson", rate=3.0, seed=7).tolist() == _offsets(50, kind="poisson", rate=3.0, seed=7).tolist()
    assert _offsets(50, kind="poisson", rate=3.0, seed=7).tolist() != _offsets(50, kind="poisson", rate=3.0, seed=8).tolist()


def test_trace_offsets_rescale_to_a_rate():
    assert trace_offsets([10.0, 11.0, 13.0], None) == [0.0, 1.0, 3.0]
    assert trace_offsets([10.0, 11.0, 13.0], 2.0) == pytest.approx([0.0, 1 / 3, 1.0])  # 2 gaps at 2/s: 1 s


def test_schedule_counts_warmup_apart():
    base = dict(base_url="http://x", arrival=ArrivalSpec(kind="constant", rate=10.0), progress=False)
    assert len(schedule(BenchSpec(**base, num_requests=7, warmup=3), None)) == 10
    by_time = schedule(BenchSpec(**base, duration_s=1.0, warmup=2), None)
    assert len(by_time) == 2 + 10 and by_time[2] == pytest.approx(0.2)
    both = schedule(BenchSpec(**base, duration_s=100.0, num_requests=4), None)
    assert len(both) == 4


def test_trace_schedule_must_fit_the_trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "prompt_len": 3, "output_len": 1}) + "\n" for i in range(5)))
    spec = BenchSpec(base_url="http://x", workload=WorkloadSpec(kind="trace", trace_path=str(path)),
                     arrival=ArrivalSpec(kind="trace"), warmup=1)
    w = build_workload(spec.workload)
    assert schedule(spec, w) == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match="the trace holds 5 requests"):
        schedule(spec.model_copy(update={"num_requests": 5}), w)


def test_spec_errors_name_the_missing_piece():
    with pytest.raises(ValueError, match="--num-requests N or --duration S"):
        BenchSpec(base_url="http://x")
    with pytest.raises(ValueError, match="need a rate"):
        ArrivalSpec(kind="gamma")
    with pytest.raises(ValueError, match="need a concurrency"):
        ArrivalSpec(kind="closed")
    with pytest.raises(ValueError, match="trace workload"):
        BenchSpec(base_url="http://x", arrival=ArrivalSpec(kind="trace"), num_requests=3)
    with pytest.raises(ValueError, match="vocab_size"):
        WorkloadSpec(vocab_size=5)
