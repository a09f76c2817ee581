"""A batch of submits answered as each is decided, so one waiting for room holds back no other."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable

from actors.protocol.messages import Admitted, Rejected

log = logging.getLogger("tandem.scheduler")
_ANSWER_GAP_S = 0.002


async def answers_as_decided(admissions: list[Awaitable[Admitted | Rejected]]
                             ) -> AsyncIterator[tuple[tuple[int, Admitted | Rejected], ...]]:
    """`(index, answer)` tuples: the first decided at once (the client's next batch waits for them), the
    rest in chunks a few ms apart, since each streamed item costs about a Ray call."""
    tasks = {asyncio.ensure_future(a): i for i, a in enumerate(admissions)}
    done, pending = await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
    yield tuple((tasks[t], _answer(t)) for t in done)
    while pending:
        await asyncio.sleep(_ANSWER_GAP_S)
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        yield tuple((tasks[t], _answer(t)) for t in done)


def _answer(task: asyncio.Task) -> Admitted | Rejected:
    try:
        return task.result()
    except Exception as exc:  # a bug in one admission must not cost the batch's other answers
        log.exception("admitting a request failed")
        return Rejected(f"internal error while admitting the request: {type(exc).__name__}: {exc}", None)
