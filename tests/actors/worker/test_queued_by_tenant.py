"""A worker reports its queued prompt tokens by tenant: the scheduler's tenant-aware TTFT prediction
(cluster/control/scheduler/routing.py) counts another tenant's queue only in part, where the batcher takes tenants
in turn."""

from __future__ import annotations

import zmq

from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, WorkerRequest
from actors.protocol.sampling_params import SamplingParams
from actors.protocol.worker_commands import SubmitAttempt
from actors.worker.actor import Worker
from actors.worker.inbox import Inbox
from actors.worker.spec import WorkerSpec
from tests.helpers.cluster import load


def test_the_inbox_counts_waiting_prompts_by_tenant_until_taken():
    inbox = Inbox("w")
    inbox.arrived(AttemptId("r1", "0"), 300, "a")
    inbox.arrived(AttemptId("r2", "0"), 50, "b")
    inbox.arrived(AttemptId("r3", "0"), 20, "a")
    inbox.arrived(AttemptId("r3", "0"), 20, "a")  # a duplicate submit is one prompt
    assert inbox.prompt_tokens_by_tenant() == {"a": 320, "b": 50} and inbox.prompt_tokens == 370
    inbox.taken(AttemptId("r1", "0"))
    inbox.taken(AttemptId("r1", "0"))  # idempotent
    assert inbox.prompt_tokens_by_tenant() == {"a": 20, "b": 50} and inbox.prompt_tokens == 70


def test_a_worker_reports_the_prompts_it_has_not_prefilled_by_tenant():
    engine = load("colocated.yaml").engine_config(detokenize=False)
    worker = Worker(WorkerSpec("colocated-t", "colocated", engine, lease_s=30.0, heartbeat_s=0.02))
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink_url = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def submit(request_id: str, tenant: str | None, tokens: int) -> None:
        request = GenerateRequest(request_id, tuple(range(10, 10 + tokens)), params, sink_url, tenant)
        worker.handle(SubmitAttempt("colocated-t", WorkerRequest(AttemptId(request_id, "0"), request)))

    try:
        worker.inject_fault("slow_step", 1.0)
        submit("first", "a", 8)  # its step is slow: what comes next waits in the inbox, then the engine
        worker.check_integrity()  # (the inbox is first in, first out: the slow step starts after this)
        submit("a-1", "a", 300)
        submit("b-1", "b", 40)
        submit("none-1", None, 16)
        stats = worker.check_integrity()  # drained with the submits, before the engine's next step
        assert dict(stats.queued_prefill_by_tenant) == {"a": 300, "b": 40, None: 16}
        assert stats.queued_prefill_tokens == 356
        while (stats := worker.check_integrity()).live_requests:
            sink.recv()
        assert stats.queued_prefill_by_tenant == () and stats.queued_prefill_tokens == 0
    finally:
        sink.close(linger=0)
        worker.shutdown()
