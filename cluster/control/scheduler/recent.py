"""A bounded memory of recent keys, each kept for a while: what a restarted or racing peer may still
name after the scheduler has moved on (an abort that came before its request, an attempt that ended)."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Recent(Generic[K, V]):
    def __init__(self, keep_s: float, most: int, clock=time.monotonic):
        self._keep_s, self._most, self._clock = keep_s, most, clock
        self._items: OrderedDict[K, tuple[float, V]] = OrderedDict()  # oldest first

    def put(self, key: K, value: V) -> None:
        now = self._clock()
        self._items[key] = (now, value)
        self._items.move_to_end(key)
        while self._items and (len(self._items) > self._most or next(iter(self._items.values()))[0] < now - self._keep_s):
            self._items.popitem(last=False)

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        return None if item is None or item[0] < self._clock() - self._keep_s else item[1]
