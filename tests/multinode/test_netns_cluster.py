"""tandem across three hosts (network namespaces with their own addresses): prefill on one, decode on
another, the ingress on the head; KV pages cross hosts over tcp (CURVE), and greedy outputs equal the
single-process engine's."""

from __future__ import annotations

import functools
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.engine.engine import Engine
from actors.protocol.sampling_params import SamplingParams
from tests.helpers.cluster import load, workload
from tests.multinode.conftest import API_KEY, integrity, netns

pytestmark = pytest.mark.slow  # hosts in network namespaces, links shaped and cut


@functools.cache
def _engine() -> Engine:
    return Engine(load("local.yaml").engine_config())


def _fault_free(prompts: list, max_tokens: int) -> list[str]:
    """The single-process engine's greedy text of each prompt (ignore_eos)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [r.outputs[0].text for r in _engine().generate(prompts, params)]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _metric(url: str, name: str) -> dict[tuple, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def test_greedy_across_hosts_equals_the_engine(served):
    """Only w1 offers `tandem_prefill` and only w2 `tandem_decode`: the pools cannot share a host, so
    every transfer counted here crossed the bridge."""
    prompts, params = workload(12)
    expected = [r.outputs[0].text for r in _engine().generate(prompts, params)]
    client = _client(served)
    for prompt, p, want in zip(prompts, params, expected):
        out = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=p.max_tokens, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want
    # From the workers themselves once idle: /metrics shows their last heartbeat, which may lag a step.
    workers = _drained()["workers"].values()
    transfers = {k: sum(w[k] for w in workers) for k in ("transfers_sent", "adopted", "transfers_failed")}
    assert transfers["transfers_sent"] == transfers["adopted"] > 0 and transfers["transfers_failed"] == 0, transfers
    assert sum(_metric(served, "tandem:kv_transfer_bytes").values()) > 0
    assert sum(_metric(served, "tandem:kv_link_bytes_per_second").values()) > 0  # measured across the bridge


def _fault_counts(url: str, report: dict | None = None) -> dict[str, float]:
    """The workers' handoff faults (from `report`, an integrity report, or a fresh one) and the moves."""
    workers = (report or integrity())["workers"].values()
    counts = {k: sum(w[k] for w in workers) for k in ("transfers_failed", "leases_expired", "late_pages_dropped")}
    counts["migrations"] = sum(_metric(url, "tandem:request_migrations_total").values())
    return counts


def _drained(timeout_s: float = 120) -> dict:
    """Wait until no request is in flight and no worker holds KV for one; the integrity report."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = integrity()
        busy = {wid: s for wid, s in report["workers"].items()
                if s["used_blocks"] or s["reserved"] or s["held"] or s["live_requests"]}
        if not busy and report["scheduler"]["in_flight"] == 0:
            return report
        assert time.monotonic() < deadline, report
        time.sleep(2)


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int, out: dict) -> None:
    started = time.monotonic()
    try:
        r = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        out["text"], out["finish_reason"] = r.choices[0].text, r.choices[0].finish_reason
    except openai.APIStatusError as exc:
        out["status"], out["error"] = exc.status_code, exc.message
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = round(time.monotonic() - started, 1)


def _finished(url: str) -> float:
    """Requests the ingress has finished (whatever the reason): it counts their moves when it does."""
    return sum(_metric(url, "tandem:requests_finished_total").values())


def _every_decode_worker_adopted(report: dict) -> bool:
    return all(s["adopted"] for wid, s in report["workers"].items() if wid.startswith("decode"))


def _connect_every_decode_host(client: openai.OpenAI, timeout_s: float = 120) -> dict:
    """Until the prefill worker (w1) has handed pages to both decode workers, two requests at a time: its
    sockets to both decode hosts are connected, as on a cluster that has served a while. The integrity
    report that shows it."""
    deadline = time.monotonic() + timeout_s
    while not _every_decode_worker_adopted(report := integrity()):
        assert time.monotonic() < deadline, report["workers"]
        pair = [{}, {}]
        threads = [threading.Thread(target=_complete, args=(client, list(range(30 + i, 60 + i)), 4, r), daemon=True)
                   for i, r in enumerate(pair)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert all("text" in r for r in pair), pair
    return report


def test_a_partition_between_prefill_and_decode_hosts(served):
    """w1 (the prefill host) can reach neither decode host (w2, w3) while six requests run, so every one of
    them crosses the cut (local_prefill is off: every prompt is prefilled on w1 and handed off): its first
    token reaches the client (w1 still reaches the head), its pages never reach the decode worker, whose
    reservation ends with the lease (5 s), and the client moves the request with the token it has: it runs
    whole on a decode worker, w1 not needed. So while the cut holds, each request crosses it once and moves
    once (a cut that drops nothing fails here), and ends with the fault-free text or a clean error, none
    hangs. Then nothing leaks, and once the link is back every request succeeds without a restart."""
    prompts, _ = workload(6)
    max_tokens = 24
    expected = _fault_free(prompts, max_tokens)
    client = _client(served)
    # (else a send to a host never reached before waits out its whole timeout on w1's engine thread)
    before, finished_before = _fault_counts(served, _connect_every_decode_host(client)), _finished(served)
    results = [{} for _ in prompts]
    threads = [threading.Thread(target=_complete, args=(client, p, max_tokens, r), daemon=True)
               for p, r in zip(prompts, results)]
    for decode_host in ("w2", "w3"):
        netns("partition", decode_host, "w1")
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a request hung"
        deadline = time.monotonic() + 60  # the ingress counts a request's moves as it finishes it
        while _finished(served) < finished_before + len(prompts):
            assert time.monotonic() < deadline, "the ingress did not finish every request"
            time.sleep(0.2)
        report = integrity()
        hit = {k: v - before[k] for k, v in _fault_counts(served, report).items()}
    finally:
        netns("heal", "w2", "w3")
    print("partition:", hit, [r.get("seconds") for r in results])
    for r, want in zip(results, expected):
        assert r.get("text") == want or ("error" in r and r.get("status", 500) >= 400), r
    # Each request crossed the cut: its reservation ended with the lease, and it moved.
    lost = report["scheduler"]["counters"]["workers_lost"]
    assert hit["leases_expired"] >= len(prompts) and hit["migrations"] >= len(prompts), (hit, lost)
    ok = sum(r.get("text") == want for r, want in zip(results, expected))
    _drained()
    after = [{} for _ in prompts]
    for p, r in zip(prompts, after):
        _complete(client, p, max_tokens, r)
    assert [r.get("text") for r in after] == expected, after
    print(f"partition: {len(prompts)} requests across the cut, {hit['leases_expired']:.0f} leases ended, "
          f"{hit['migrations']:.0f} moves; {ok}/{len(prompts)} completed with the fault-free text, the rest "
          "ended with an error; all served after it healed")


def test_a_slow_lossy_link_still_hands_off(served):
    """Prefill -> decode links at 20 Mbit/s with 1% loss: every handoff still completes (adopted, not
    failed or expired) and the outputs are the fault-free ones."""
    prompts, _ = workload(6)
    max_tokens = 16
    expected = _fault_free(prompts, max_tokens)
    client = _client(served)
    before = _fault_counts(served)
    adopted_before = sum(w["adopted"] for w in integrity()["workers"].values())
    for peer in ("w2", "w3"):
        netns("shape", "w1", peer, "rate", "20mbit", "loss", "1%")
    try:
        results = [{} for _ in prompts]
        for p, r in zip(prompts, results):
            _complete(client, p, max_tokens, r)
    finally:
        netns("heal", "w1")
    assert [r.get("text") for r in results] == expected, results
    hit = {k: v - before[k] for k, v in _fault_counts(served).items()}
    adopted = sum(w["adopted"] for w in _drained()["workers"].values()) - adopted_before
    assert adopted == len(prompts) and hit["transfers_failed"] == hit["leases_expired"] == 0, (adopted, hit)
    print(f"slow link: {adopted} handoffs over 20 Mbit/s + 1% loss, request seconds "
          f"{[r['seconds'] for r in results]}")


def _stream(client: openai.OpenAI, prompt: list[int], max_tokens: int, started: threading.Event,
            out: dict) -> None:
    try:
        chunks = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text, reasons = [], []
        for chunk in chunks:
            started.set()
            text.append(chunk.choices[0].text)
            reasons.append(chunk.choices[0].finish_reason)
        out["text"], out["finish_reason"] = "".join(text), reasons[-1]
    except Exception as exc:  # recorded: the test says which stream failed and how
        out["error"] = f"{type(exc).__name__}: {exc}"


def test_a_decode_host_dies_mid_stream(served):
    """Every process of w2 (one of the two decode hosts) is killed and its link goes silent while four
    streams run: the ones it served move to w3's decode worker and end with the fault-free text, none
    hangs, and no KV is left committed. (Last in the module: w2 stays dead.)"""
    prompts, _ = workload(4)
    max_tokens = 160
    expected = _fault_free(prompts, max_tokens)
    client = _client(served)
    results = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(client, p, max_tokens, s, r), daemon=True)
               for p, s, r in zip(prompts, started, results)]
    for t in threads:
        t.start()
    assert all(s.wait(120) for s in started), results
    moved_before = sum(_metric(served, "tandem:request_migrations_total").values())
    killed = time.monotonic()
    netns("kill", "w2")
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    took = time.monotonic() - killed
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got.get("text") == want and got.get("finish_reason") == "length", (i, got)
    # Not asserted: that w2 served one of them (decode placement spreads by free KV; idle, 1-4 moved;
    # in one stressed run none did).
    migrated = sum(_metric(served, "tandem:request_migrations_total").values()) - moved_before
    report = _drained()  # the lost worker's commitments are reclaimed; the survivors drain
    assert "decode-0" not in report["workers"] or "decode-1" not in report["workers"]  # one decode host is gone
    print(f"host loss: {migrated:.0f} streams moved, all four done {took:.1f} s after the kill")
