"""What a request says beside its prompt and sampling: who it is for, recorded in its usage record
(`user`, `safety_identifier`, `metadata`), and how the scheduler should admit and route it
(`service_tier` or vLLM's `priority`: the order among waiting requests; `prompt_cache_key`: requests of
the tenant with the same key prefer the worker that served the last of them)."""

from __future__ import annotations

from dataclasses import dataclass

from cluster.frontend.http.protocol import ApiError

# OpenAI's service tiers -> admission order (lower first): flex waits behind default, priority goes ahead.
TIER_PRIORITY = {"auto": 0, "default": 0, "flex": 1, "priority": -1}
MAX_METADATA = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


@dataclass(frozen=True)
class AdmissionHints:
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    priority: int = 0
    affinity: str | None = None

    @property
    def labels(self) -> dict:
        """The usage record's fields (those the request set): who it is for, and how it was admitted and
        routed (a bill may depend on the tier, as OpenAI's does)."""
        named = {"user": self.user, "safety_identifier": self.safety_identifier, "metadata": self.metadata,
                 "service_tier": self.service_tier, "priority": self.priority or None,
                 "prompt_cache_key": self.affinity}
        return {k: v for k, v in named.items() if v is not None}


def hints_of(req) -> AdmissionHints:
    """A chat, completions or Responses request's hints (fields it does not declare count as unset)."""
    tier = getattr(req, "service_tier", None)
    priority = getattr(req, "priority", None) or 0
    if tier is not None and priority:
        raise ApiError(400, "service_tier and priority both order admission: set one", "priority")
    return AdmissionHints(req.user, getattr(req, "safety_identifier", None), check_metadata(getattr(req, "metadata", None)),
                          tier, TIER_PRIORITY[tier] if tier is not None else priority,
                          getattr(req, "prompt_cache_key", None))


def check_metadata(metadata: dict | None) -> dict | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA:
        raise ApiError(400, f"metadata holds at most {MAX_METADATA} pairs", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise ApiError(400, f"metadata: keys are strings of at most {MAX_METADATA_KEY} characters, values "
                           f"strings of at most {MAX_METADATA_VALUE}", "metadata")
    return metadata
