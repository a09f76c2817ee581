"""Structured-output grammars compile off the worker's engine thread.

A compile can take seconds (xgrammar's time grows faster than the spec; StructuredOutput bounds the spec,
and the ingress refuses one that does not compile within its budget). On the engine thread it would stop
every other request's steps and the worker's reports for as long. So a submitted request whose grammar is
not compiled yet waits here while a thread of this desk compiles it (xgrammar releases the GIL), and goes
back to the engine thread's inbox when it is done; an abort meanwhile drops it. A decode worker warms the
grammar of a request it reserves KV for, so that it is compiled by the time the pages land.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from actors.engine.engine import Engine
from actors.protocol.ids import AttemptId
from actors.protocol.sampling_params import SamplingParams

log = logging.getLogger("tandem.worker")


class GrammarDesk:
    def __init__(self, engine: Engine, put: Callable, worker_id: str, delay: Callable[[], float] = lambda: 0.0,
                 wait: Callable[[float], None] = time.sleep):
        """`put(handler, args)`: the engine thread's inbox; `delay()`: the slow_grammar chaos hook's extra
        seconds for the next compile, spent in `wait(seconds)` (faults.py: until the fault is cleared)."""
        self._engine, self._put, self._worker_id, self._delay, self._wait = engine, put, worker_id, delay, wait
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"grammar-{worker_id}")
        self._waiting: set[AttemptId] = set()  # engine thread only

    def hold(self, attempt: AttemptId, params: SamplingParams, then: Callable[[], None],
             failed: Callable[[str], None]) -> bool:
        """Engine thread: False when the request needs no compile (go on now). Else True: its grammar compiles
        on this desk's thread, then `then()` runs on the engine thread (or `failed(why)`), unless dropped."""
        if self._engine.grammar_ready(params):
            return False
        self._waiting.add(attempt)
        future = self._pool.submit(self._compile, params, self._delay())
        future.add_done_callback(lambda done: self._put(self._compiled, (attempt, done, then, failed)))
        return True

    def warm(self, params: SamplingParams) -> None:
        """Compile ahead of a later adoption (a decode worker's reservation); its errors show there."""
        if not self._engine.grammar_ready(params):
            self._pool.submit(self._engine.compile_grammar, params)

    def drop(self, attempt: AttemptId) -> bool:
        """Engine thread: forget a waiting request (aborted); False if it was not waiting."""
        if attempt not in self._waiting:
            return False
        self._waiting.discard(attempt)
        return True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: SamplingParams, delay_s: float) -> None:
        if delay_s:
            self._wait(delay_s)
        self._engine.compile_grammar(params)

    def _compiled(self, attempt: AttemptId, done: Future, then: Callable[[], None],
                  failed: Callable[[str], None]) -> None:
        if not self.drop(attempt):
            return  # aborted while it compiled
        exc = done.exception() if not done.cancelled() else RuntimeError("the worker is stopping")
        if exc is None:
            then()
        else:
            failed(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}")
