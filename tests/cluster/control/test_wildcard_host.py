"""Multi-node configs bind `transfer.host: 0.0.0.0`; what other processes connect to must name this
node's address instead (a worker on another machine cannot connect to "tcp://0.0.0.0:port")."""

from __future__ import annotations

import ray

from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from tests.helpers.cluster import load, wait_until_idle, workload


def wildcard_config():
    config = load("local.yaml")
    return config.model_copy(update={"transfer": config.transfer.model_copy(
        update={"host": "0.0.0.0", "zmq_transport": "tcp"})})


def test_wildcard_bind_advertises_the_node_ip(ray_session, expected):
    node_ip = ray.util.get_node_ip_address()
    prompts, params = workload()
    cluster = Cluster.start(wildcard_config())
    try:
        infos = ray.get([w.info.remote() for w in cluster.workers.values()], timeout=30)
        endpoints = {i.worker_id: i.kv_endpoints[0].endpoint for i in infos if i.kv_endpoints}
        assert set(endpoints) == {"decode-0"}
        client = open_client(cluster)
        for endpoint in [*endpoints.values(), client.sink]:
            assert endpoint.startswith(f"tcp://{node_ip}:"), endpoint
            assert "0.0.0.0" not in endpoint
        results = client.generate(prompts, params)
        assert [r[0].token_ids for r in results] == expected  # pages and tokens crossed the tcp sockets
        state = wait_until_idle(cluster)
        sent = sum(s["transfers_sent"] for s in state["workers"].values())
        assert sent == sum(s["adopted"] for s in state["workers"].values()) > 0
        assert all(s["used_blocks"] == 0 and s["transfers_failed"] == 0 for s in state["workers"].values())
    finally:
        cluster.shutdown()
