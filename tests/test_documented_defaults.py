"""The shipped defaults the documentation states are the ones the code ships: each is read from the config
models (cluster/control/config.py) or the one place the code defines it, and compared with the number the
README or a written page of docs/ prints (tests/helpers/docs_pages.py), so neither can drift from the other.
("README" below is all of those pages; the generated reference pages have a test of their own.)

The README writes a default as "`key` (N s)" (or "(N)", "(default N)"); every such mention of a config
key is checked, and the keys below must be among them: the liveness bounds, the HTTP connection limits and
the shedding limits a user tunes first. A few numbers the README states in prose have a check of their own."""

from __future__ import annotations

import inspect
import re
import types
import typing
from pydantic import BaseModel

from cluster.control.config import TandemConfig
from tests.helpers.docs_pages import written_text

README = written_text()

REQUIRED = {
    "scheduler.heartbeat_timeout_s", "scheduler.progress_timeout_s", "scheduler.lease_s",
    "scheduler.queue_timeout_s", "scheduler.max_queued", "ingress.request_timeout_s", "ingress.header_timeout_s",
    "ingress.body_timeout_s", "ingress.keep_alive_timeout_s", "ingress.max_connections_per_client",
    "ingress.default_max_tokens", "ingress.default_tokens_per_minute", "engine.tenant_slowdown",
    "scheduler.local_prefill_max_tokens", "scheduler.local_prefill_overflow_s", "autoscaler.slo.react_s",
    "ingress.max_connections", "ingress.keyed_connection_reserve", "ingress.default_max_concurrency",
}
# "`key` (N unit" followed by the end of the parenthesis or of its first clause.
MENTION = re.compile(r"`([a-z_][a-z0-9_.]*)`\s+\((?:default\s+)?(\d[\d,]*(?:\.\d+)?)(?:\s*(s|ms))?(?=[);:,])")


def _section(annotation) -> type[BaseModel] | None:
    """The config section class a field holds (also when optional), else None."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)


def config_defaults(model: type[BaseModel] = TandemConfig, prefix: str = "") -> dict[str, object]:
    """Every leaf key of the config with its default, by dotted path (`scheduler.lease_s`)."""
    out = {}
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            out.update(config_defaults(section, f"{prefix}{name}."))
        elif not field.is_required():
            out[f"{prefix}{name}"] = field.get_default(call_default_factory=True)
    return out


DEFAULTS = config_defaults()


def resolve(key: str) -> str:
    """The dotted path a README mention names: itself, or the one path ending in it."""
    if key in DEFAULTS:
        return key
    found = [path for path in DEFAULTS if path.endswith("." + key)]
    assert len(found) == 1, f"the README's `{key}` names {found or 'no config key'}: qualify it or fix it"
    return found[0]


def documented() -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for key, number, unit in MENTION.findall(README):
        if key in DEFAULTS or any(path.endswith("." + key) for path in DEFAULTS):
            value = float(number.replace(",", "")) / (1000 if unit == "ms" else 1)
            out.setdefault(resolve(key), []).append(value)
    return out


def test_every_default_the_readme_states_is_the_shipped_one():
    stated = documented()
    wrong = {key: (values, DEFAULTS[key]) for key, values in stated.items() if any(v != DEFAULTS[key] for v in values)}
    assert not wrong, f"README says (key: (stated, shipped)): {wrong}"
    assert REQUIRED <= set(stated), f"the README states no default for {sorted(REQUIRED - set(stated))}"


def test_the_shedding_limit_unset_is_half_the_progress_bound():
    from cluster.control.config import SchedulerSection
    from cluster.control.scheduler.scheduler_state import SchedulerSettings
    from cluster.control.scheduler.ttft_guard import shed_guard

    section = SchedulerSection()
    settings = SchedulerSettings(
        mode="disaggregated", routing=section.routing, block_size=16, model_id="m", reserve=section.reserve,
        max_queued=section.max_queued, queue_timeout_s=section.queue_timeout_s, local_prefill=section.local_prefill,
        local_prefill_penalty=section.local_prefill_penalty, prefill_s_per_token=section.prefill_s_per_token,
        transfer_bytes_per_s=section.transfer_bytes_per_s, max_predicted_ttft_s=section.max_predicted_ttft_s)
    (stated,) = re.findall(r"`scheduler\.max_predicted_ttft_s`, or, unset \(the default\), half of the progress "
                           r"bound, (\d+) s", README.replace("\n", " "))
    assert section.max_predicted_ttft_s is None
    assert shed_guard(settings).limit_s == float(stated) == section.progress_timeout_s / 2


def test_slow_connections_are_closed_at_the_header_timeout():
    (stated,) = re.findall(r"slowloris and idle connections are closed at (\d+) s", README.replace("\n", " "))
    assert float(stated) == DEFAULTS["ingress.header_timeout_s"]


def test_zmq_handshakes_are_bounded_as_stated():
    from kv_transfer.curve import HANDSHAKE_TIMEOUT_S

    (stated,) = re.findall(r"finished its handshake within (\d+) s", README.replace("\n", " "))
    assert float(stated) == HANDSHAKE_TIMEOUT_S


def test_the_moves_and_the_audit_are_the_code_s():
    from cluster.frontend.client import TandemClient
    from cluster.frontend.request_stream import RequestStream

    text = README.replace("\n", " ")
    (moves,) = re.findall(r"a request is moved at most (\d+) times", text)
    (audit,) = re.findall(r"ingress's audit: every (\d+) s", text)
    assert int(moves) == inspect.signature(RequestStream).parameters["max_migrations"].default
    assert float(audit) == inspect.signature(TandemClient).parameters["audit_s"].default


def test_functions_take_their_defaults_from_the_config():
    """A default written again beside the config (a keyword's default in a function) drifts from it unseen."""
    from cluster.frontend.http.app import create_app
    from cluster.frontend.http.body_guard import BodyGuard

    for function in (create_app, BodyGuard):
        default = inspect.signature(function).parameters["body_timeout_s"].default
        assert default in (inspect.Parameter.empty, DEFAULTS["ingress.body_timeout_s"]), function
