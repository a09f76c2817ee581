"""Which workers a resize still waits for: the ones starting (spawned, not yet serving) and the ones leaving
(told to drain, not yet stopped). Owned by scaling.py, kept on the cluster.

A resize that does not wait (the autoscaler's) hands its cold starts and drains to a thread and returns,
so the next resize may come while they finish. That one counts a starting worker as a member of its pool
(it will serve, as the autoscaler sized for) and a leaving one as gone, and neither removes nor flips a
worker that is still starting.
"""

from __future__ import annotations

import threading


class ResizeState:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards the two sets and the cluster's replica counts
        self.starting: set[str] = set()
        self.leaving: set[str] = set()

    def check_integrity(self, cluster) -> None:
        """Every worker a resize waits for is one of the cluster's (a stopped one is forgotten here in the
        same step), and none is both starting and leaving."""
        with self.lock:
            both = self.starting & self.leaving
            unknown = (self.starting | self.leaving) - set(list(cluster.workers))
        if both or unknown:
            raise RuntimeError(f"resize state: starting and leaving {sorted(both)}, not workers {sorted(unknown)}")
