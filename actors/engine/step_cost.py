"""What an engine step costs as its batch grows, measured on this worker, and the batch that keeps a step
within a slowdown of the cheapest one.

Why: tenants share a worker's steps. On a GPU a decode step costs about the same for 1 or 64 sequences,
so one tenant's flood barely slows another's tokens; on a CPU (or with long prefill chunks) the step
time grows with its tokens, and a tenant with 32 sequences would make another's every token several
times slower. The batcher caps a step shared by several tenants at `max_tokens(slowdown)`, and the prompt
tokens of a step that carries decodes at what `tokens_within(step budget)` leaves beside them (TPOT).

Steps are bucketed by token count (powers of two) with an exponential average of their seconds per
bucket; between buckets the cost is interpolated, past the largest one extrapolated from the last two.
"""

from __future__ import annotations

_DECAY = 0.9  # weight of a bucket's old average against one new step


class StepCost:
    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}  # bucket (a power of two) -> average step seconds
        self._tokens: dict[int, float] = {}  # bucket -> average tokens of its steps

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        bucket = 1 << (tokens - 1).bit_length()
        if bucket in self._seconds:
            self._seconds[bucket] = _DECAY * self._seconds[bucket] + (1 - _DECAY) * seconds
            self._tokens[bucket] = _DECAY * self._tokens[bucket] + (1 - _DECAY) * tokens
        else:
            self._seconds[bucket], self._tokens[bucket] = seconds, float(tokens)

    def seconds(self, tokens: int) -> float | None:
        """The expected seconds of a step of `tokens`; None until two sizes of step were seen."""
        points = []
        for b in sorted(self._seconds):  # a bigger step never counts as cheaper (noise can say so)
            points.append((self._tokens[b], max(self._seconds[b], points[-1][1] if points else 0.0)))
        if len(points) < 2:
            return None
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, s0), (t1, s1) in zip(points, points[1:]):
            if tokens <= t1 or (t1, s1) == points[-1]:
                slope = (s1 - s0) / max(t1 - t0, 1e-9)
                return s0 + slope * (tokens - t0)
        raise AssertionError("unreachable")

    def max_tokens(self, slowdown: float, limit: int) -> int:
        """The most tokens (up to `limit`) whose step takes at most `slowdown` x a one-token step, from
        what was measured; `limit` while too little is known to tell."""
        base = self.seconds(1)
        if base is None:
            return limit
        return max(self.tokens_within(slowdown * base, limit), 1)

    def tokens_within(self, seconds: float, limit: int) -> int | None:
        """The most tokens (0 to `limit`) whose step is expected to take at most `seconds`; None until two
        sizes of step were seen."""
        if self.seconds(1) is None:
            return None
        if self.seconds(limit) <= seconds:
            return limit
        lo, hi = 0, limit  # seconds() never decreases with tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.seconds(mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo
