"""Overload is refused at the door, at once: with the admission limits as shipped (`queue_timeout_s`,
`max_predicted_ttft_s` unset: half of `progress_timeout_s`, the door's floor of waiting requests), a
newcomer that would wait behind requests the scheduler is not admitting gets 429 with Retry-After in a
moment, not after waiting out the queue timeout as the requests ahead of it do.

A 1P+1D cluster whose decode worker's KV (1,005 blocks here) is all but taken by one long stream: every
request after it needs 5 blocks where 4 are free, so it waits for admission. The stream is far longer
than the test (16k tokens, ~1 min of decoding on this box; the default tiny model's 2k context decodes in
~4 s since the CPU attention kernel, less than the door needs to see 8 waiting), and it is cancelled once
the refusal was seen. Requests arrive one every
half second (open loop) until the first refusal. It must come from the door (the admission rate the
scheduler measured while they waited, times the requests waiting, past the limit), while every request
sent before it is still waiting, and be answered in a small part of the queue timeout. A single newcomer,
below the door's floor, waits the whole shipped queue timeout instead (slow tier)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from cluster.control.scheduler.admission_door import _FLOOR
from cluster.control.config import SchedulerSection
from tests.helpers.cluster import load, wait_until_idle
from tests.helpers.http_server import MODEL, serving
from tests.helpers.models import make_hf_model

SHIPPED = SchedulerSection()
HOLDER = {"prompt": list(range(10, 26)), "max_tokens": 16_000}  # 16 + 16,000 tokens: 1,001 of the 1,005 blocks
NEWCOMER = {"prompt": list(range(30, 46)), "max_tokens": 64}  # 16 + 64 tokens: 5 blocks
ARRIVAL_S = 0.5  # one newcomer every half second
# Newcomers sent at most: the door refuses once _FLOOR wait and the rate it measures is low enough (a few
# seconds of waiting); more than this without a refusal is a failure.
MOST = 4 * _FLOOR


@pytest.fixture(scope="module")
def full_server(ray_session, tmp_path_factory):
    """The default tiny model's shape with a 16k context, served under the default's name."""
    model = make_hf_model(tmp_path_factory.mktemp("long-context"), "llama", with_tokenizer=True, vocab_size=2048,
                          hidden_size=128, num_hidden_layers=4, intermediate_size=384, rope_scaling=None,
                          max_position_embeddings=16_384)
    config = load("local.yaml", num_kv_blocks=1005)
    config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(model)}),
                                       "ingress": config.ingress.model_copy(update={"served_model_name": MODEL})})
    limits = {"queue_timeout_s", "max_predicted_ttft_s", "progress_timeout_s", "max_queued"}
    shipped = SHIPPED.model_dump(include=limits)
    assert config.scheduler.model_dump(include=limits) == shipped  # the admission limits as shipped
    with serving(config) as live:
        yield live


class Sent:
    """One request from a thread of its own: when it was sent and answered, and the answer."""

    def __init__(self, url: str, body: dict, stream: bool = False):
        self.sent, self.answered, self.status, self.headers, self.body = time.monotonic(), None, None, {}, ""
        self.first_token, self._cancel = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body, stream), daemon=True)
        self._thread.start()

    def _run(self, url: str, body: dict, stream: bool) -> None:
        body = {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": stream, **body}
        with httpx.Client(timeout=300) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
            self.status, self.headers = resp.status_code, resp.headers
            if resp.status_code == 200 and stream:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.first_token.set()
                    if self._cancel.is_set():
                        break  # closing the connection aborts the request
            self.body = resp.read().decode() if not stream or resp.status_code != 200 else ""
            self.answered = time.monotonic()

    def cancel(self) -> None:
        self._cancel.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"no answer within {timeout_s} s"


def test_a_newcomer_behind_requests_not_being_admitted_is_refused_at_once(full_server):
    cluster, url = full_server
    holder = Sent(url, HOLDER, stream=True)
    assert holder.first_token.wait(60), "the long stream never started"
    newcomers: list[Sent] = []
    while not any(n.answered is not None and n.status == 429 for n in newcomers):
        assert len(newcomers) < MOST, [(n.status, n.body) for n in newcomers]
        newcomers.append(Sent(url, NEWCOMER))
        time.sleep(ARRIVAL_S)  # the arrival process (open loop), not a wait for an event
    refused = next(n for n in newcomers if n.answered is not None and n.status == 429)
    before = newcomers[:newcomers.index(refused)]
    # From the door: the requests waiting ahead of it were at least the floor, and none had been answered.
    assert len(before) >= _FLOOR and all(n.answered is None or n.answered > refused.answered for n in before), \
        [(n.status, n.answered and n.answered - refused.answered) for n in before]
    assert holder.answered is None or holder.answered > refused.answered  # its KV was still taken
    assert "overloaded" in refused.body and "wait for admission" in refused.body, refused.body
    assert int(refused.headers["retry-after"]) >= 1
    # At once: a small part of the queue timeout the requests ahead of it wait out (honest on a busy box).
    answer_s = refused.answered - refused.sent
    assert answer_s < SHIPPED.queue_timeout_s / 10, answer_s
    print(f"refused after {len(before)} waiting, answered in {answer_s:.3f} s; the first ahead of it had waited "
          f"{refused.answered - before[0].sent:.1f} s; Retry-After {refused.headers['retry-after']}")
    holder.cancel()
    holder.join(60)
    for n in newcomers:
        n.join(SHIPPED.queue_timeout_s + 60)
        assert n.status in (200, 429), (n.status, n.body)
    wait_until_idle(cluster)


@pytest.mark.slow  # the shipped queue timeout (30 s) waited out
def test_a_request_waiting_for_room_is_turned_away_at_the_shipped_queue_timeout(full_server):
    """One newcomer behind the stream holding the KV (fewer waiting than the door's floor: the door lets it
    wait) waits for room about the whole shipped wait budget (`queue_timeout_s`, 30 s, and the unset TTFT
    target, half the progress bound, also 30 s: the guard turns it away once the wait plus its predicted
    first token would pass that), not a fraction of it, and is then a 429 for want of KV room.
    (test_ingress.py's overload test sees the 429 at 1 s and cannot tell a wait cut short.) The decode
    worker's next step is held for longer than the wait, so the KV stays taken however fast the box."""
    cluster, url = full_server
    budget_s = min(SHIPPED.queue_timeout_s, SHIPPED.progress_timeout_s / 2)
    hold_s = budget_s + 15  # under the progress bound: the held stream is not moved
    assert hold_s < SHIPPED.progress_timeout_s and SHIPPED.max_predicted_ttft_s is None
    holder = Sent(url, HOLDER, stream=True)
    try:
        assert holder.first_token.wait(60), "the long stream never started"
        ray.get(cluster.workers["decode-0"].inject_fault.remote("slow_step", hold_s), timeout=30)
        newcomer = Sent(url, NEWCOMER)
        newcomer.join(budget_s + 60)
        waited_s = newcomer.answered - newcomer.sent
        print(f"turned away after {waited_s:.1f} s (wait budget {budget_s:g} s): {newcomer.body}")
        assert newcomer.status == 429 and ("for KV room" in newcomer.body or "no worker has room" in newcomer.body), (
            newcomer.status, newcomer.body)
        assert holder.answered is None  # the KV was still taken
        assert 0.9 * budget_s <= waited_s < budget_s + 10, waited_s
    finally:
        holder.cancel()
        holder.join(hold_s + 60)
    wait_until_idle(cluster)
