"""The worker's inbox: the only way a Ray method (any thread) reaches the engine thread.

A method puts a command (a handler and its argument, and a Future when the caller waits for the answer);
the engine thread drains the inbox between steps and runs each command in order. The inbox also keeps the
two facts about submitted attempts that must be true before the engine thread has seen them: which
attempts arrived since the last report (the scheduler learns from the report that its submit landed) and
how many prompt tokens wait here (queued prefill work the scheduler's TTFT prediction must count).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from actors.protocol.ids import AttemptId

log = logging.getLogger("tandem.worker")


class Inbox:
    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._prompt_tokens = 0  # of submitted attempts the engine thread has not taken yet
        self._waiting: dict[AttemptId, tuple[str | None, int]] = {}  # those attempts: (tenant, prompt tokens)
        self._received: list[AttemptId] = []  # submitted since the last report

    # ---- any thread ----

    def put(self, handler, arg) -> None:
        self._queue.put((handler, arg, None))

    def ask(self, handler, arg) -> Future:
        self._queue.put((handler, arg, future := Future()))
        return future

    def call(self, handler, arg, timeout_s: float):
        return self.ask(handler, arg).result(timeout=timeout_s)

    def arrived(self, attempt: AttemptId, prompt_tokens: int, tenant: str | None) -> None:
        """A submitted attempt, before its command is put: confirmed by the next report, its prompt counted
        as waiting (for its tenant, the request's cache salt) until the engine thread takes it (`taken`)."""
        with self._lock:
            self._received.append(attempt)
            if attempt not in self._waiting:  # (a duplicate submit is dropped by the engine: counted once)
                self._waiting[attempt] = (tenant, prompt_tokens)
                self._prompt_tokens += prompt_tokens

    # ---- the engine thread ----

    def taken(self, attempt: AttemptId) -> None:
        with self._lock:
            _, tokens = self._waiting.pop(attempt, (None, 0))
            self._prompt_tokens -= tokens

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    def prompt_tokens_by_tenant(self) -> dict[str | None, int]:
        by_tenant: dict[str | None, int] = {}
        with self._lock:
            for tenant, tokens in self._waiting.values():
                by_tenant[tenant] = by_tenant.get(tenant, 0) + tokens
        return by_tenant

    def take_received(self) -> tuple[AttemptId, ...]:
        with self._lock:
            received, self._received = tuple(self._received), []
        return received

    def drain(self, block_s: float | None) -> None:
        """Run every waiting command in order; `block_s`: first wait up to this long for one (None: don't)."""
        try:
            item = self._queue.get(timeout=block_s) if block_s is not None else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run(*item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return

    def _run(self, handler, arg, future: Future | None) -> None:
        try:
            result = handler(*arg) if isinstance(arg, tuple) else handler(arg)
        except Exception as exc:  # a bad command must not kill the engine thread
            if future is None:
                log.exception("worker %s: %s failed", self.worker_id, handler.__name__)
            else:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)
