"""A decode worker that never comes back: migration gives up with a clear error, within the deadline."""

from __future__ import annotations

import time

import ray

from actors.protocol.sampling_params import SamplingParams
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load


def test_migration_gives_up_with_a_clear_error_when_no_worker_returns(ray_session):
    """Past the admission deadline with no decode worker, the stream ends with finish_reason 'error'."""
    config = load("local.yaml")
    config = config.model_copy(update={"scheduler": config.scheduler.model_copy(
        update={"heartbeat_timeout_s": 1.0, "local_prefill": False, "queue_timeout_s": 1.0})})
    cluster = Cluster.start(config)
    try:
        client = open_client(cluster)
        stream = client.stream(list(range(30, 50)), SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True),
                               timeout_s=60)
        next(stream)
        ray.kill(cluster.workers["decode-0"], no_restart=True)  # gone for good
        start = time.monotonic()
        events = list(stream)
        assert events[-1].finished and events[-1].finish_reason == "error"
        assert "could not be migrated" in events[-1].error
        assert time.monotonic() - start < 30  # admission deadline + detection; a hang would be the 60 s timeout
    finally:
        cluster.workers.pop("decode-0")
        cluster.shutdown()
