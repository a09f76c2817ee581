"""What a KV handoff costs on each prefill -> decode link, learnt from the handoffs themselves.

Every decode worker reports, per handoff, the bytes and the seconds from the prefill worker starting
the send to the last page written (`TransferSample`). Per link this owner fits seconds = latency +
bytes / bandwidth by least squares with exponential forgetting (recent handoffs weigh most), so a link
that slows down or recovers is followed within ten handoffs. With handoffs of one size only, the
fit cannot tell latency from bandwidth and takes the mean seconds per byte. A link not measured yet
costs the mean of the measured links into the same decode worker (else of all measured links, else
what the configured bandwidth says): guessing it faster than its measured peers would pull every
prompt onto it, slower would keep every prompt off it and it would never be measured.

Placement reads `seconds(prefill, decode, nbytes)`: a slow link makes a remote prefill look late, and
the cost model then prefills on the decode worker itself (routing.py). Then no handoff measures that
link any more, so a fit is dropped once it has had no sample for `_STALE_S`: the link is tried again
(one handoff) and a link that recovered is used again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from actors.protocol.messages import TransferSample

_DECAY = 0.8  # weight of the past per new sample: about the last 5-10 handoffs count
_MIN_SPREAD = 0.25  # relative spread of sizes below which the fit takes the mean seconds per byte
_STALE_S = 30.0  # a link unmeasured this long is measured again


@dataclass
class LinkFit:
    weight: float = 0.0
    sum_x: float = 0.0  # bytes
    sum_y: float = 0.0  # seconds
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    samples: int = 0
    updated: float = 0.0  # time.monotonic() of the last sample

    def add(self, nbytes: float, seconds: float, now: float) -> None:
        self.updated = now
        for name in ("weight", "sum_x", "sum_y", "sum_xx", "sum_xy"):
            setattr(self, name, getattr(self, name) * _DECAY)
        self.weight += 1.0
        self.sum_x += nbytes
        self.sum_y += seconds
        self.sum_xx += nbytes * nbytes
        self.sum_xy += nbytes * seconds
        self.samples += 1

    def line(self) -> tuple[float, float]:
        """(latency seconds, seconds per byte), both >= 0."""
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if mean_x > 0 and var_x > (_MIN_SPREAD * mean_x) ** 2:
            per_byte = (self.sum_xy / self.weight - mean_x * mean_y) / var_x
            latency = mean_y - per_byte * mean_x
            if per_byte > 0 and latency >= 0:
                return latency, per_byte
        return 0.0, (mean_y / mean_x if mean_x > 0 else 0.0)


def _cost(fit: LinkFit, nbytes: int) -> float:
    latency, per_byte = fit.line()
    return latency + nbytes * per_byte


@dataclass(frozen=True)
class LinkEstimate:
    """One link's fitted cost, for people and metrics."""

    latency_s: float
    bytes_per_s: float | None  # None: no time per byte measurable (instant handoffs)
    samples: int


class LinkCosts:
    def __init__(self, default_bytes_per_s: float):
        self._default_per_byte = 1.0 / default_bytes_per_s
        self._links: dict[tuple[str, str], LinkFit] = {}
        self._into: dict[str, set[str]] = {}  # decode worker -> prefill workers with a fit into it
        # Mean (latency, seconds per byte) of the fits into a decode worker ("" : of all), until one changes.
        self._means: dict[str, tuple[float, float]] = {}
        self._swept = 0.0

    def observe(self, decode_worker: str, samples: tuple[TransferSample, ...], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sample in samples:
            if not (sample.nbytes > 0 and math.isfinite(sample.seconds) and sample.seconds >= 0):
                continue  # a report is trusted for its counts, not for physics
            fit = self._links.setdefault((sample.prefill_worker, decode_worker), LinkFit())
            self._into.setdefault(decode_worker, set()).add(sample.prefill_worker)
            fit.add(sample.nbytes, sample.seconds, now)
            self._changed(decode_worker)

    def seconds(self, prefill_worker: str, decode_worker: str, nbytes: int, now: float | None = None) -> float:
        self._drop_stale(time.monotonic() if now is None else now)
        fit = self._links.get((prefill_worker, decode_worker))
        if fit is not None:
            return _cost(fit, nbytes)
        mean = self._mean(decode_worker if self._into.get(decode_worker) else "")
        if mean is None:
            return nbytes * self._default_per_byte
        return mean[0] + nbytes * mean[1]

    def _mean(self, decode_worker: str) -> tuple[float, float] | None:
        """Kept until a fit into it changes: read per candidate per request, it must not scan the links."""
        mean = self._means.get(decode_worker)
        if mean is None:
            fits = ([self._links[(src, decode_worker)] for src in self._into[decode_worker]] if decode_worker
                    else list(self._links.values()))
            if not fits:
                return None
            lines = [f.line() for f in fits]
            mean = self._means[decode_worker] = (sum(x for x, _ in lines) / len(lines),
                                                 sum(y for _, y in lines) / len(lines))
        return mean

    def _changed(self, decode_worker: str) -> None:
        self._means.pop(decode_worker, None)
        self._means.pop("", None)

    def forget(self, worker_id: str) -> None:
        """A worker that is gone or restarted: a replacement may sit on another host."""
        for link in [link for link in self._links if worker_id in link]:
            self._drop(link)

    def _drop_stale(self, now: float) -> None:
        if now - self._swept < 1.0:  # a sweep per second is enough for a 30 s staleness, and O(1) per call
            return
        self._swept = now
        for link in [link for link, fit in self._links.items() if now - fit.updated > _STALE_S]:
            self._drop(link)

    def _drop(self, link: tuple[str, str]) -> None:
        src, dst = link
        del self._links[link]
        into = self._into.get(dst)
        if into is not None:
            into.discard(src)
            if not into:
                del self._into[dst]
        self._changed(dst)

    def estimates(self) -> dict[str, LinkEstimate]:
        """By "prefill->decode"."""
        out = {}
        for (src, dst), fit in sorted(self._links.items()):
            latency, per_byte = fit.line()
            out[f"{src}->{dst}"] = LinkEstimate(latency, 1.0 / per_byte if per_byte > 0 else None, fit.samples)
        return out

    def check_integrity(self) -> None:
        into = {(src, dst) for dst, sources in self._into.items() for src in sources}
        if into != set(self._links):
            differ = sorted(into ^ set(self._links))
            raise RuntimeError(f"link costs: the per-decode index differs from the links by {differ}")
        for link, fit in self._links.items():
            latency, per_byte = fit.line()
            assert fit.weight > 0 and fit.samples > 0, f"link {link} has no samples"
            assert latency >= 0 and per_byte >= 0 and math.isfinite(latency + per_byte), f"link {link}: {fit}"
