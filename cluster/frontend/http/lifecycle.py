"""How a non-streamed HTTP request runs in the cluster: to its end unless the client hangs up (then it is
aborted at once), and how a failed result becomes an HTTP error."""

from __future__ import annotations

import asyncio

from fastapi import Request

from actors.protocol.request_status import RequestStatus
from actors.protocol.structured_output import BUDGET_SPENT
from cluster.frontend.http.ingress import Ingress
from cluster.frontend.http.protocol import ApiError


class ClientGone(Exception):
    pass


async def run_unless_disconnected(request: Request, ingress: Ingress, opened: list, arrival: float) -> None:
    """Run non-streamed requests to their end, unless the client hangs up first: then abort them at once
    (a client that left must not keep the cluster generating for nobody)."""
    async def run() -> None:
        for stream in opened:
            async for _ in ingress.events(stream, arrival):
                pass

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(run()), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        for stream in opened:  # whatever has not started its events yet ends here too
            ingress.finish(stream, arrival)
        raise ClientGone()
    work.result()


def raise_if_failed(result, own_timeout: bool) -> None:
    """`own_timeout`: the request's `timeout` set its deadline (a 408, the client's choice), not the
    server's request_timeout_s (a 504)."""
    if result.status == RequestStatus.TIMED_OUT:
        raise ApiError(408 if own_timeout else 504, result.error or "the request ran past its deadline", None, "timeout")
    if result.finish_reason == "error":
        if result.error and result.error.startswith(BUDGET_SPENT):  # its own grammar ended it
            raise ApiError(400, result.error.removeprefix(BUDGET_SPENT), None)
        raise ApiError(500, f"the request failed in the cluster: {result.error}", None, "server_error")
