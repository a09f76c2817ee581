"""A client opened on a cluster launched in this process: the frontend stands above the control plane, so the
cluster does not make its own clients (tests/test_floors.py)."""

from __future__ import annotations

from actors.engine.text.tokenizer import has_tokenizer, load_tokenizer
from cluster.frontend.client import TandemClient


def open_client(cluster) -> TandemClient:
    """A client of `cluster` (cluster.control.lifecycle.launch.Cluster), closed by the cluster's shutdown."""
    tokenizer = load_tokenizer(cluster.model_dir) if has_tokenizer(cluster.model_dir) else None
    client = TandemClient(cluster.schedulers, tokenizer, host=cluster.config.transfer.host, keys=cluster.keys,
                          progress_timeout_s=cluster.config.scheduler.progress_timeout_s)
    cluster.closers.append(client.close)
    return client
