"""Which address to publish for a socket: a wildcard bind is not an address anyone can connect to.

Every endpoint tandem hands to another process (a KV receiver, the client's token sink, the collective
rendezvous) binds `transfer.host`. Multi-node configs bind "0.0.0.0" so that other machines can
reach the socket; the endpoint they are given must then name this node's routable IP instead.
"""

from __future__ import annotations

_WILDCARDS = {"0.0.0.0", "::", "*", ""}


def advertised_host(bind_host: str) -> str:
    """The host to put in an endpoint for a socket bound to `bind_host`: itself, unless it is a
    wildcard; then this node's IP as Ray knows it (the address other nodes reach it by)."""
    if bind_host not in _WILDCARDS:
        return bind_host
    import ray.util  # only multi-node setups need it; the transports themselves run without Ray

    return ray.util.get_node_ip_address()
