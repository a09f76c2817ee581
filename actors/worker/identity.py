"""Which worker a Ray actor process is after a role flip, kept where its restart can read it.

Ray restarts a dead actor with the arguments it was created with: a worker created as `prefill-3` and
flipped into `decode-7` would come back as `prefill-3`, in the wrong pool and under a name the cluster
no longer knows. So a flip records the worker the actor became in Ray's key-value store (the GCS, which
also holds the creation arguments), keyed by the actor's name, and a restarted actor reads it back. A
freshly created actor clears any record under its name (a crashed earlier cluster's) and starts as asked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass

import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from actors.worker.spec import WorkerSpec

log = logging.getLogger("tandem.worker")
_NAMESPACE = "tandem"


@dataclass(frozen=True)
class Became:
    """What a flip changes of a worker's spec; everything else (engine, transport, keys) stays."""

    worker_id: str
    role: str
    torch_threads: int

    def applied(self, spec: WorkerSpec) -> WorkerSpec:
        return dataclasses.replace(spec, worker_id=self.worker_id, role=self.role, torch_threads=self.torch_threads)


def remember(became: Became) -> None:
    key = _key()
    if key is not None:
        _internal_kv_put(key, json.dumps(dataclasses.asdict(became)).encode(), overwrite=True, namespace=_NAMESPACE)


def current(spec: WorkerSpec) -> WorkerSpec:
    """The spec this actor process serves with: its creation spec, or after a flip and a restart, the
    worker it had become."""
    key = _key()
    raw = None if key is None else _internal_kv_get(key, namespace=_NAMESPACE)
    if raw is None:
        return spec
    if not _restarted():
        _internal_kv_del(key, namespace=_NAMESPACE)
        return spec
    try:
        became = Became(**json.loads(raw))
    except (ValueError, TypeError) as exc:  # unreadable: the creation spec is the safer guess
        log.error("worker %s: unreadable flip record %r (%s); starting as created", spec.worker_id, raw[:200], exc)
        return spec
    log.info("worker %s restarted after becoming %s (%s)", spec.worker_id, became.worker_id, became.role)
    return became.applied(spec)


def _key() -> bytes | None:
    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return None if not name else f"identity:{name}".encode()


def _restarted() -> bool:
    with warnings.catch_warnings():  # Ray's property warns about a deprecated call of its own
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
