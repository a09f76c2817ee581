"""The ingress's structured-output compiles in flight, counted per tenant: the one owner of those counts.

xgrammar cannot stop a compile it has begun, so a compile that outlives its request's budget (the request
got its 400) goes on to its end on a thread of its own, and keeps its slot until then: its tenant's slots,
never a pool shared with every other tenant (two schemas past the budget held the ingress's only two
compile threads for a minute, and every other structured request got "did not compile within 10 s").

Who calls: `ServedModel.check_structured` takes a slot (`run`) on the event loop for each compile; the
compile's thread gives it back (through the loop) when the compile ends, whether anyone still waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Callable

MAX_COMPILES = 4  # in flight in one ingress, all tenants told (this box has 2 cores)
MAX_TENANT_COMPILES = 2  # in flight for one tenant (no keys configured: everyone is one tenant)


class CompileSlotsBusy(Exception):
    """No slot came free within the wait: `in_flight` of the tenant's compiles were running."""

    def __init__(self, in_flight: int, limit: int):
        super().__init__(f"{in_flight} structured-output compiles of this tenant are still running (at most {limit})")
        self.in_flight, self.limit = in_flight, limit


class CompileSlots:
    def __init__(self, max_compiles: int = MAX_COMPILES, max_tenant_compiles: int = MAX_TENANT_COMPILES):
        self.max_compiles, self.max_tenant_compiles = max_compiles, max_tenant_compiles
        self._by_tenant: Counter[str | None] = Counter()  # event loop only
        self._freed: asyncio.Condition | None = None
        self.started = Counter()  # compiles begun per tenant (for tests and metrics)

    @property
    def in_flight(self) -> int:
        return sum(self._by_tenant.values())

    def of(self, tenant: str | None) -> int:
        return self._by_tenant[tenant]

    async def run(self, tenant: str | None, compile_fn: Callable[[], object], budget_s: float):
        """Run `compile_fn` on a thread of its own once `tenant` has a slot, and return its result, within
        `budget_s` in all: asyncio.TimeoutError past it (the compile goes on, holding its slot), or
        CompileSlotsBusy when no slot came free in time."""
        deadline = time.monotonic() + budget_s
        freed = self._condition()
        async with freed:
            while not self._free(tenant):
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(freed.wait(), max(left, 0.0))
                except asyncio.TimeoutError:
                    raise CompileSlotsBusy(self._by_tenant[tenant], self.max_tenant_compiles) from None
            self._by_tenant[tenant] += 1
            self.started[tenant] += 1
        loop = asyncio.get_running_loop()
        result = loop.create_future()

        def finish(ok: bool, value) -> None:  # on the loop
            self._give_back(tenant)
            if not result.done():
                result.set_result(value) if ok else result.set_exception(value)

        def compile_thread() -> None:
            try:
                value, ok = compile_fn(), True
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting request, if any)
                value, ok = exc, False
            loop.call_soon_threadsafe(finish, ok, value)

        threading.Thread(target=compile_thread, name=f"grammar-check-{tenant}", daemon=True).start()
        result.add_done_callback(lambda done: done.cancelled() or done.exception())  # seen, if left behind
        return await asyncio.wait_for(asyncio.shield(result), max(deadline - time.monotonic(), 0.0))

    def check_integrity(self) -> None:
        if any(n < 0 or n > self.max_tenant_compiles for n in self._by_tenant.values()) or \
                self.in_flight > self.max_compiles:
            raise RuntimeError(f"compile slots: {dict(self._by_tenant)} in flight, at most "
                               f"{self.max_tenant_compiles} a tenant and {self.max_compiles} in all")

    def _free(self, tenant: str | None) -> bool:
        return self._by_tenant[tenant] < self.max_tenant_compiles and self.in_flight < self.max_compiles

    def _give_back(self, tenant: str | None) -> None:
        self._by_tenant[tenant] -= 1
        if not self._by_tenant[tenant]:
            del self._by_tenant[tenant]
        freed = self._condition()

        async def notify() -> None:
            async with freed:
                freed.notify_all()

        asyncio.ensure_future(notify())

    def _condition(self) -> asyncio.Condition:
        if self._freed is None:  # made on the loop that uses it
            self._freed = asyncio.Condition()
        return self._freed
