"""Acceptance 4: pages whose format does not match the receiver are refused with a clear error; the
request fails cleanly, nothing is left reserved or held, and the cluster keeps serving."""

from __future__ import annotations

import dataclasses

import ray

from actors.protocol.sampling_params import SamplingParams
from actors.worker.remote import worker_actor
from actors.worker.spec import WorkerSpec
from cluster.control.lifecycle.launch import Cluster
from cluster.control.scheduler.actor import Scheduler, SchedulerSettings
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle


def start_mismatched(decode_dtype: str) -> Cluster:
    """A 1P+1D cluster whose decode worker caches KV in another dtype than the prefill worker."""
    config = load("local.yaml")
    engine = config.engine_config(detokenize=False)
    settings = SchedulerSettings(
        mode="disaggregated", routing="cache_aware", block_size=engine.block_size, model_id="m",
        reserve="prompt_plus_max_tokens", max_queued=64, queue_timeout_s=5.0, local_prefill=False,
        local_prefill_penalty=1.0, prefill_s_per_token=2e-4, transfer_bytes_per_s=2e9,
    )
    scheduler = ray.remote(Scheduler).options(num_cpus=0).remote(settings)
    specs = {
        "prefill-0": WorkerSpec("prefill-0", "prefill", engine, lease_s=5.0, heartbeat_s=0.05),
        "decode-0": WorkerSpec("decode-0", "decode", dataclasses.replace(engine, dtype=decode_dtype), lease_s=5.0,
                                heartbeat_s=0.05),
    }
    workers = {wid: worker_actor().options(num_cpus=0.5, max_concurrency=16).remote(spec, scheduler)
               for wid, spec in specs.items()}
    for info in ray.get([w.info.remote() for w in workers.values()], timeout=120):
        ray.get(scheduler.register.remote(info, workers[info.worker_id]), timeout=30)
    return Cluster(config, scheduler, workers, owns_ray=False, model_dir=engine.model)


def test_dtype_mismatch_fails_the_request_and_the_cluster_keeps_serving(ray_session):
    cluster = start_mismatched("bfloat16")
    try:
        client = open_client(cluster)
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        for attempt in range(2):  # the second request shows the workers are still serving
            (result,) = client.generate([[10 + attempt, 11, 12, 13, 14, 15]], params)[0]
            assert result.finish_reason == "error"
            assert "dtype" in result.error and "float32" in result.error and "bfloat16" in result.error, result.error
        state = wait_until_idle(cluster)
        for stats in state["workers"].values():
            assert stats["reserved"] == 0 and stats["held"] == 0 and stats["used_blocks"] == 0, stats
        assert state["scheduler"]["in_flight"] == 0
        assert state["scheduler"]["counters"]["failed"] == 2
    finally:
        cluster.shutdown()
