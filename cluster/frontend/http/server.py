"""Run the HTTP ingress in this process, in front of a started cluster."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from actors.engine.model.loader import read_hf_config
from cluster.control.launch import Cluster
from cluster.frontend.http.admin import add_admin_routes
from cluster.frontend.http.app import Ingress, create_app
from cluster.frontend.http.gate import Gate, TenantLimits
from cluster.frontend.http.protocol import RequestCaps


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
    i = config.ingress
    caps = RequestCaps(i.max_n, i.max_prompts, i.max_sequences, i.max_stop_strings, i.max_stop_chars, i.max_logit_bias)
    return Ingress(cluster.client(), served_model_name(cluster), max_len, gate, hf["vocab_size"], caps=caps,
                   max_body_bytes=config.ingress.max_body_bytes, queue_size=config.ingress.stream_queue_tokens,
                   request_timeout_s=config.ingress.request_timeout_s)


def make_server(cluster: Cluster, host: str, port: int) -> uvicorn.Server:
    app = create_app(build_ingress(cluster), cluster.scheduler)
    ingress = cluster.config.ingress
    add_admin_routes(app, cluster, ingress.admin_key, host)
    # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: behind a same-host proxy every client
    # would then be whatever address it claims. Only the configured proxies are believed.
    trusted = ingress.trusted_proxies
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                         proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None))
