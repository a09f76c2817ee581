"""Ray's metrics servers that no option keeps off the network, kept from starting.

A Ray that tandem starts (`include_dashboard=False`) still runs its dashboard head and autoscaler monitor,
and each starts a Prometheus server on every interface with no authentication (the session name, pids,
memory, the cluster's resources), unless the node's address is loopback, which Ray resolves to the
machine's address. Each reads its port from the environment and carries on without the server when the
port is taken. So before `ray.init` both are pointed at a port this process holds, listening on loopback
(a wildcard bind cannot share it), for as long as the Ray it started lives. RAY_enable_metrics_collection=1
keeps Ray's metrics as Ray serves them."""

from __future__ import annotations

import os
import socket

PORT_VARIABLES = ("DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")
_held: socket.socket | None = None


def hold() -> int | None:
    """The port now held for both servers (the environment names it), or None when Ray's metrics were asked for
    or a port was already chosen by the user."""
    global _held
    if os.environ.get("RAY_enable_metrics_collection") == "1" or any(v in os.environ for v in PORT_VARIABLES):
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)  # listening, so no other socket binds the port, never accepted from
    _held = sock
    port = sock.getsockname()[1]
    for variable in PORT_VARIABLES:
        os.environ[variable] = str(port)
    return port


def release() -> None:
    """After the Ray that `hold` served has shut down."""
    global _held
    if _held is not None:
        for variable in PORT_VARIABLES:
            if os.environ.get(variable) == str(_held.getsockname()[1]):
                del os.environ[variable]
        _held.close()
        _held = None
