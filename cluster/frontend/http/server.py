"""Run the HTTP ingress in this process, in front of a started cluster."""

from __future__ import annotations

import resource
from pathlib import Path

import uvicorn

from actors.engine.model.loader import read_hf_config
from actors.tracing.tracer import start as start_tracing
from cluster.control.config import IngressSection, TenantSection
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.open_client import open_client
from cluster.frontend.http.admin import LOOPBACK, AdminAccess, add_admin_routes
from cluster.frontend.http.autoscaler_metrics import AutoscalerCollector
from cluster.frontend.http.app import create_app
from cluster.frontend.http.connection_table import ConnectionCollector, ConnectionTable
from cluster.frontend.http.connections import guarded_h11
from cluster.frontend.http.gate import Gate, tenant_limits
from cluster.frontend.http.protocol import ApiError
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.response_store import ResponseStore
from cluster.frontend.http.served_model import ServedModel
from cluster.frontend.http.protocol import RequestCaps


TANDEM_ROOT = Path(__file__).resolve().parents[3]  # where chat_templates/ ships


def read_template(name: str) -> str:
    """`ingress.chat_template`: a file, a relative path found from the working directory first, then from
    tandem's own directory (so configs/default.yaml's `chat_templates/...` works from anywhere)."""
    path = Path(name)
    candidates = [path] if path.is_absolute() else [path, TANDEM_ROOT / path]
    for candidate in candidates:
        try:
            return candidate.read_text()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ValueError(f"ingress.chat_template: cannot read {name!r}: {exc.strerror}") from None
    raise ValueError(f"ingress.chat_template: no file {name!r} (looked in {', '.join(str(c) for c in candidates)})")


def served_model_name(cluster: Cluster) -> str:
    config = cluster.config
    if config.ingress.served_model_name:
        return config.ingress.served_model_name
    path = config.model.path
    if path.startswith("builtin:"):
        return path.split(":", 1)[1]
    return Path(path).stem if path.endswith(".gguf") else Path(path).name


def check_exposure(ingress: IngressSection, host: str) -> dict[str, TenantSection]:
    """The API keys to serve with; refuses an ingress reachable from the network that nobody has to
    authenticate to, unless the config says so (`ingress.allow_anonymous`)."""
    tenants = ingress.tenants()
    if host not in LOOPBACK and not tenants and not ingress.allow_anonymous:
        raise ValueError(f"refusing to serve on {host} with no API keys: set ingress.api_keys (or api_keys_file), "
                         "bind 127.0.0.1, or set ingress.allow_anonymous: true")
    return tenants


def build_ingress(cluster: Cluster, host: str = "127.0.0.1", ingress: IngressSection | None = None) -> Ingress:
    """The ingress of `cluster`, as its config's ingress section says (or `ingress`, e.g. a benchmark's)."""
    config = cluster.config
    hf = read_hf_config(cluster.model_dir)
    max_len = config.model.max_model_len or hf["max_position_embeddings"]
    i = ingress or config.ingress
    tenants = check_exposure(i, host)
    gate = Gate(tenant_limits(tenants, i.default_tokens_per_minute, i.default_max_concurrency))
    caps = RequestCaps(i.max_n, i.max_prompts, i.max_sequences, i.max_stop_strings, i.max_stop_chars, i.max_logit_bias,
                       i.default_max_tokens, i.unknown_fields == "accept", i.max_allowed_token_ids,
                       i.max_response_logprobs)
    template = None if i.chat_template is None else read_template(i.chat_template)
    client = open_client(cluster)
    model = ServedModel(served_model_name(cluster), client.tokenizer, max_len, hf["vocab_size"], caps, template,
                        i.tool_call_parser)
    return Ingress(client, model, gate, max_body_bytes=i.max_body_bytes, queue_size=i.stream_queue_tokens,
                   request_timeout_s=i.request_timeout_s, hide_cache_hits=not tenants and host not in LOOPBACK,
                   tenant_metrics=i.metrics_tenant_labels,
                   stored=ResponseStore(i.stored_responses, i.stored_response_bytes),
                   tracer=start_tracing(config.observability.tracing(), "tandem-ingress"))


def make_server(cluster: Cluster, host: str, port: int, ingress: IngressSection | None = None,
                autoscaler=None) -> uvicorn.Server:
    """`autoscaler`: the cluster's, when it runs one (its record goes on /metrics)."""
    ingress = ingress or cluster.config.ingress
    front = build_ingress(cluster, host, ingress)
    if autoscaler is not None:
        front.metrics.registry.register(AutoscalerCollector(autoscaler))
    app = create_app(front, cluster.schedulers, AdminAccess(ingress.admin(), host).check, ingress.body_timeout_s)
    add_admin_routes(app, cluster)
    # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: behind a same-host proxy every client
    # would then be whatever address it claims. Only the configured proxies are believed.
    trusted = ingress.trusted_proxies
    table = connection_table(ingress, keyed=bool(ingress.tenants()))
    front.metrics.registry.register(ConnectionCollector(table))
    protocol = guarded_h11(ingress.header_timeout_s, table, lambda header: _valid_key(front.gate, header))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           proxy_headers=bool(trusted), forwarded_allow_ips=trusted or None,
                                           http=protocol, timeout_keep_alive=ingress.keep_alive_timeout_s))
    server.connection_table = table  # for check_integrity() in tests; its counts are on /metrics
    server.ingress = front  # its client's token sink, for the tests that break it
    return server


def connection_table(ingress: IngressSection, keyed: bool) -> ConnectionTable:
    """The ingress's connection limits. `max_connections` stays below the process's open-file limit, leaving
    a quarter of it (up to 1,024) for the sockets to the cluster and files: past the limit `accept` fails
    and uvicorn cannot even refuse. Without API keys nobody can show one, so nothing is reserved."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    max_open = ingress.max_connections
    if soft != resource.RLIM_INFINITY:
        max_open = max(1, min(max_open, soft - min(1024, soft // 4)))
    reserve = min(ingress.keyed_connection_reserve, max_open // 2) if keyed else 0
    return ConnectionTable(max_open, reserve, ingress.max_connections_per_client)


def _valid_key(gate: Gate, authorization: bytes | None) -> bool:
    if authorization is None:
        return False
    try:
        return gate.authenticate(authorization.decode("latin-1")) is not None
    except ApiError:
        return False
