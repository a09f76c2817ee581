"""The HTTP ingress's configuration: its address, limits and timeouts, tenants (API keys) and admin key.
Part of `TandemConfig` (config.py, which re-exports both sections)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError

from cluster.control.config_base import Strict as _Strict, where as _where


class TenantSection(_Strict):
    tenant: str = Field(description="tenant name: also the prefix-cache salt of its requests")
    requests_per_minute: float | None = Field(None, gt=0, description="request rate limit; null: none")
    tokens_per_minute: float | None = Field(
        None, gt=0, description="prompt + max_tokens x n per minute (what a request did not generate is given back "
        "when it ends); null: ingress.default_tokens_per_minute")
    max_concurrency: int | None = Field(None, gt=0, description="requests in flight at once; null: no quota")
    kv_share: float | None = Field(
        None, gt=0, le=1, description="most of the decode (colocated) pool's KV the tenant's requests may hold at "
        "once, and of the admission queue; null: an equal share, 1 / the number of tenants")


class IngressSection(_Strict):
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, gt=0, lt=65536, description="HTTP port")
    served_model_name: str | None = Field(None, description="the `model` clients send; null: the model directory's name")
    chat_template: str | None = Field(None, description="a Jinja chat template file used instead of the model's "
                                      "(e.g. chat_templates/chatml-tools.jinja for tools on a ChatML model); a "
                                      "relative path is looked up from the working directory, then from tandem's")
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description="how tool calls are read back from the model's answer (tool_choice auto needs one)")
    max_n: int = Field(16, gt=0, description="largest `n` a request may ask for")
    max_prompts: int = Field(64, gt=0, description="most prompts in one /v1/completions request")
    max_sequences: int = Field(256, gt=0, description="most sequences (n x prompts) one request may start")
    max_stop_strings: int = Field(16, gt=0, description="most stop strings (and stop token ids) in one request")
    max_stop_chars: int = Field(256, gt=0, description="longest stop string")
    max_logit_bias: int = Field(1024, gt=0, description="most logit_bias entries in one request")
    max_allowed_token_ids: int = Field(4096, gt=0, description="most allowed_token_ids in one request")
    max_response_logprobs: int = Field(
        1_000_000, gt=0, description="most logprob entries one response may hold: (prompt tokens scored by echo or "
        "prompt_logprobs + prompts x max_tokens when logprobs are asked) x n x (1 + top logprobs); more get 400. Each "
        "is ~100 bytes of JSON")
    max_body_bytes: int = Field(1 << 20, gt=0, description="larger request bodies get 413")
    stored_responses: int = Field(
        1024, ge=0, description="responses (and chat completions with `store: true`) kept per tenant in the "
        "ingress's memory for previous_response_id and GET /v1/responses/{id}, least recently used dropped first")
    stored_response_bytes: int = Field(64 << 20, ge=0, description="most bytes (JSON) of stored responses per tenant")
    default_max_tokens: int = Field(
        1024, gt=0, description="max_tokens of a chat request that sets none (or the rest of the context, if less)")
    unknown_fields: Literal["reject", "accept"] = Field(
        "reject", description="a request field the API does not know: `reject` answers 400 naming it; `accept` "
        "logs its name (WARNING) and goes on, for clients that send vendor extras")
    stream_queue_tokens: int = Field(4096, gt=0, description="undelivered deltas per request before a slow client's request is aborted")
    request_timeout_s: float = Field(600.0, gt=0, description="default deadline of a request; a request's own `timeout` overrides it")
    default_tokens_per_minute: float | None = Field(
        1_000_000, gt=0, description="tokens_per_minute of a tenant that sets none; null: no limit")
    admin_key: str | None = Field(
        None, description="bearer token for the operator endpoints (/admin/*, sent as `Authorization: Bearer <key>`); "
        "null (and no admin_key_file): the ingress generates one at start in ~/.cache/tandem/admin_key (0600)")
    trusted_proxies: list[str] = Field(
        default_factory=list, description="proxy addresses whose X-Forwarded-For is believed; empty: the client is "
        "the TCP peer, whatever headers it sends")
    api_keys: dict[str, TenantSection] = Field(
        default_factory=dict, description="API key -> tenant and its limits; empty (and no api_keys_file): no "
        "authentication"
    )
    api_keys_file: str | None = Field(
        None, description="a YAML file of more `api_keys` (key -> tenant section), e.g. a mounted Kubernetes Secret; "
        "read at start, so keys stay out of the config itself")
    admin_key_file: str | None = Field(None, description="a file holding the admin key (instead of admin_key)")
    allow_anonymous: bool = Field(
        False, description="serve a non-loopback ingress with no API keys (everyone is one tenant and shares one "
        "prefix cache; its cache hits are then not reported)")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's head (request line and headers) must arrive whole within this many "
        "seconds of the connection opening or of the previous response; else the connection is closed (slowloris)")
    body_timeout_s: float = Field(
        30.0, gt=0, description="a request's whole body must arrive within this many seconds of its head; else 408 "
        "and the connection is closed")
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="an idle keep-alive connection is closed after this many seconds (uvicorn's "
        "timeout_keep_alive)")
    max_connections_per_client: int | None = Field(
        1024, gt=0, description="open connections one client address (the TCP peer) may hold; more are answered 503 "
        "and closed. Behind a proxy every client is the proxy: raise it or set null (no cap)")
    max_connections: int = Field(
        8192, gt=0, description="open HTTP connections in all (at most the process's open-file limit less a quarter, "
        "up to 1,024, for its other files); a new one past it closes the longest-waiting connection with no request in "
        "progress, or gets 503")
    keyed_connection_reserve: int = Field(
        1024, ge=0, description="with API keys, this many of max_connections are kept for connections that have sent a "
        "valid key: keyless ones (which includes every connection before its first request head) hold the rest")
    default_max_concurrency: int | None = Field(
        512, gt=0, description="max_concurrency (requests in flight at once; more get 429) of a tenant that sets "
        "none; null: no quota")
    metrics_tenant_labels: bool = Field(
        False, description="export per-tenant series (tandem:tenant_kv_blocks{tenant=...}) on /metrics, which has "
        "no authentication; off: tenant names and their load are not shown")

    def tenants(self) -> dict[str, TenantSection]:
        """Every API key: the inline ones and those of `api_keys_file`."""
        keys = dict(self.api_keys)
        if self.api_keys_file:
            data = _read_secret_yaml(self.api_keys_file, "ingress.api_keys_file")
            try:
                keys.update({k: TenantSection.model_validate(v) for k, v in data.items()})
            except ValidationError as exc:
                problems = "; ".join(f"<key>.{_where(e['loc'])}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"ingress.api_keys_file {self.api_keys_file}: {problems}") from None
        return keys

    def admin(self) -> str | None:
        """The admin key, inline or from `admin_key_file`."""
        if self.admin_key_file:
            try:
                key = Path(self.admin_key_file).expanduser().read_text().strip()
            except OSError as exc:
                raise ValueError(f"ingress.admin_key_file: cannot read {self.admin_key_file}: {exc.strerror}") from None
            if not key:
                raise ValueError(f"ingress.admin_key_file {self.admin_key_file} is empty")
            return key
        return self.admin_key


def _read_secret_yaml(path: str, field: str) -> dict:
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError:
        raise ValueError(f"{field}: {path} is not YAML") from None  # the parser's message would quote a key
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {path} must hold a mapping of API key -> tenant section")
    return data
