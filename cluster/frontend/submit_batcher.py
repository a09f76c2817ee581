"""A client's submits batched per event-loop tick: one `submit_many` call to the scheduler carries every
request submitted in the same tick, and its answers stream back as they are decided.

One Ray call per request would cost the scheduler as much CPU as deciding it (~0.6 ms each on a small
box), so a client sending thousands of requests per second needs this. A request waits for nothing
when no batch is out: the batch goes out as soon as the loop finishes the current callbacks. While a
batch waits for its first answers, new submits gather for the next one (at most `_HOLD_S`): under load
batches grow by themselves and the calls per second stay about one per round trip.
"""

from __future__ import annotations

import asyncio

from actors.protocol.messages import Admitted, GenerateRequest, Rejected

_HOLD_S = 0.005


class SubmitBatcher:
    def __init__(self, scheduler):
        self._scheduler = scheduler
        self._pending: list[tuple[GenerateRequest, asyncio.Future]] = []
        self._unanswered = 0  # batches out whose first answers have not come back

    async def submit(self, request: GenerateRequest) -> Admitted | Rejected:
        """The scheduler's answer; raises what the call raised (e.g. the scheduler died under it). Always
        on the one event loop of its client (`TandemClient._send`)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((request, future))
        if len(self._pending) == 1:
            if self._unanswered:
                loop.call_later(_HOLD_S, self._flush)
            else:
                loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        if batch:
            self._unanswered += 1
            asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[tuple[GenerateRequest, asyncio.Future]]) -> None:
        futures = [future for _, future in batch]
        first = True
        try:
            answers = self._scheduler.submit_many.remote(tuple(request for request, _ in batch))
            async for ref in answers:
                for index, answer in await ref:
                    if not futures[index].done():  # (its waiter may have given up)
                        futures[index].set_result(answer)
                if first:
                    first = False
                    self._answered()
        except Exception as exc:  # the scheduler died or restarted under the batch: each waiter decides
            for future in futures:
                if not future.done():
                    future.set_exception(exc)
            return
        finally:
            if first:
                self._answered()
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError("the scheduler's answers to a batch of submits ended early"))

    def _answered(self) -> None:
        """A batch's first answers came back (or it ended): the next batch may go."""
        self._unanswered -= 1
        if self._pending and not self._unanswered:
            asyncio.get_running_loop().call_soon(self._flush)
