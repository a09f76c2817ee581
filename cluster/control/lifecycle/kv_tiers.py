"""The per-node host KV tiers (actors/kv_tier/): started by the launch, one on every alive node, when
`kv_tier.host_bytes` > 0; found again by name (for metrics); killed at shutdown. Nodes that join later have
no tier yet: their workers serve without one."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.kv_tier.actor import TIER_PREFIX, KVTierActor, tier_name
from kv_transfer.host_tier import TierStats


def start_tiers(host_bytes: int, namespace: str) -> dict[str, object]:
    """Node id -> its tier actor. Not restarted: a dead tier's workers go on without it."""
    tiers = {}
    for node in ray.nodes():
        if node.get("Alive"):
            node_id = node["NodeID"]
            tiers[node_id] = ray.remote(KVTierActor).options(
                name=tier_name(node_id), namespace=namespace, num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(host_bytes)
    ray.get([t.stats.remote() for t in tiers.values()], timeout=60)  # constructed, so workers find them
    return tiers


def stop_tiers(tiers: dict[str, object]) -> None:
    for tier in tiers.values():
        try:
            ray.get(tier.shutdown.remote(), timeout=10)
        except Exception:  # already gone: nothing of it to close
            pass
        ray.kill(tier, no_restart=True)


def tier_stats(timeout_s: float = 5.0) -> dict[str, TierStats]:
    """Node id -> its tier's stats, for every tier that answers ({} with the tier off)."""
    named = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(TIER_PREFIX)]
    out = {}
    for name, namespace in named:
        try:
            out[name.removeprefix(TIER_PREFIX)] = ray.get(
                ray.get_actor(name, namespace=namespace).stats.remote(), timeout=timeout_s)
        except Exception:  # a tier that died: its series stop
            pass
    return out
