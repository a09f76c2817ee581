"""A started cluster behind the real HTTP ingress, served from a thread of the test process."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import uvicorn

from cluster.control.config import TandemConfig
from cluster.control.lifecycle.launch import Cluster
from cluster.frontend.http.server import make_server

MODEL = "tiny-llama"  # the embedded default's served name
STOP_TIMEOUT_S = 30.0  # uvicorn stops once its open connections have closed


@contextmanager
def running(http: uvicorn.Server) -> Iterator[str]:
    """Runs a uvicorn server in a thread of this process; yields its base URL (over loopback)."""
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not http.started:
            assert time.monotonic() < deadline, "the HTTP server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{http.servers[0].sockets[0].getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=STOP_TIMEOUT_S)
        assert not thread.is_alive(), f"the HTTP server did not stop within {STOP_TIMEOUT_S:g} s (a connection left open?)"


@contextmanager
def serving(config: TandemConfig) -> Iterator[tuple[Cluster, str]]:
    """Yields (cluster, base URL); stops the server and the cluster afterwards."""
    cluster = Cluster.start(config)
    try:
        with running(make_server(cluster, "127.0.0.1", 0)) as url:
            yield cluster, url
    finally:
        cluster.shutdown()
