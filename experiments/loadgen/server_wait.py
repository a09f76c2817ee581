"""Wait, with a deadline, until the server answers at all before the load starts.

`tandem serve ... &` followed at once by `tandem bench serve` (the README's recipe) must not fail
because the cluster is still starting: `tandem serve` opens its port only once every worker is up, so
the first answer from /v1/models means the server is ready. A wrong URL still fails, after the wait.
"""

from __future__ import annotations

import time

import httpx


def wait_for_server(root_url: str, timeout_s: float, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            httpx.get(f"{root_url}/v1/models", headers=headers, timeout=10.0)
            return  # any HTTP answer: whether it lists a model is fetch_model's question
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise ValueError(f"no answer from {root_url}/v1/models within {timeout_s:g} s "
                                 f"({type(exc).__name__}: {exc})") from None
        if not said:
            print(f"waiting up to {timeout_s:g} s for {root_url} to answer (the server may still be starting)",
                  flush=True)
            said = True
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
