"""What a receiving loop threw away, and why: the count behind `tandem:dropped_messages_total`.

Every loop that reads a socket open to the network survives what it reads: a message that is not
what it expects is dropped here and the loop goes on. Reasons are short fixed words:
- `malformed`: not a message of the expected type (undecodable bytes, wrong frames);
- `refused`: well-formed, but not admissible (another page layout, no such lease, out-of-range ids);
- `error`: handling it raised something unexpected; logged with its traceback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import zmq

log = logging.getLogger("tandem.drops")
_LOG_EVERY_S = 5.0  # garbage can arrive at line rate; the log gets one line per reason this often


class DropCounter:
    def __init__(self, socket: str):
        self.socket = socket
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._logged: dict[str, float] = {}

    def drop(self, reason: str, detail: object = "", exc_info: bool = False) -> None:
        with self._lock:
            self._counts[reason] += 1
            now = time.monotonic()
            quiet = now - self._logged.get(reason, -_LOG_EVERY_S) < _LOG_EVERY_S
            if not quiet:
                self._logged[reason] = now
            total = self._counts[reason]
        if not quiet:
            log.warning("%s dropped a %s message (%d so far): %s", self.socket, reason, total, detail,
                        exc_info=exc_info)

    def survived(self, exc: Exception) -> bool:
        """What one receive (or the handling of its message) raised, counted; False when it says the socket
        is closed, and the loop should end. A loop's `except Exception` calls this, so that garbage, a bug
        in one message's handling and a transient socket error all cost that message only."""
        if isinstance(exc, zmq.ZMQError):
            if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                return False
            self.drop("error", exc)
        else:
            self.drop("error", exc, exc_info=True)
        return True

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
