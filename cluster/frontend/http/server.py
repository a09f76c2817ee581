"""Run the HTTP ingress in this process, in front of a started cluster."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from actors.engine.model.loader import read_hf_config
from cluster.control.launch import Cluster
from cluster.frontend.http.admin import add_admin_routes
from cluster.frontend.http.app import Ingress, create_app
from cluster.frontend.http.gate import Gate, TenantLimits


def served_model_name(cluster: Cluster) -> str:
    config = cluster.config
    if config.ingress.served_model_name:
        return config.ingress.served_model_name
    path = config.model.path
    return path.split(":", 1)[1] if path.startswith("builtin:") else Path(path).name


def build_ingress(cluster: Cluster) -> Ingress:
    config = cluster.config
    hf = read_hf_config(cluster.model_dir)
    max_len = config.model.max_model_len or hf["max_position_embeddings"]
    gate = Gate({key: TenantLimits(**t.model_dump()) for key, t in config.ingress.api_keys.items()})
    return Ingress(cluster.client(), served_model_name(cluster), max_len, gate, hf["vocab_size"], max_n=config.ingress.max_n,
                   max_body_bytes=config.ingress.max_body_bytes, queue_size=config.ingress.stream_queue_tokens,
                   request_timeout_s=config.ingress.request_timeout_s)


def make_server(cluster: Cluster, host: str, port: int) -> uvicorn.Server:
    app = create_app(build_ingress(cluster), cluster.scheduler)
    add_admin_routes(app, cluster, cluster.config.ingress.admin_key)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
