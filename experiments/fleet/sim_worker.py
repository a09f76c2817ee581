"""A simulated worker: the real worker's control surface and protocol types, no model.

It takes the scheduler's commands (submit, reserve, release, abort), "prefills" a prompt at a token
budget per step (what its prefix cache already holds is skipped), pushes a page-less handoff note to the
decode worker the scheduler named, decodes one synthetic token per running request per step, and
reports what a real worker reports: stats, finished attempts, KV events of its prefix cache, received
attempts, first-token waits, adopted handoffs. Token deltas go to the client's sink like a real
worker's. Time is the host's step clock (sim_host.py); nothing here blocks or touches Ray.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from actors.protocol.handoff_phase import HandoffPhase
from actors.protocol.ids import AttemptId
from actors.protocol.kv_events import BlockRemoved, BlockStored
from actors.protocol.messages import (
    FinishedAttempt, FirstTokenWait, HandedOff, HandoffNote, KvRankEndpoint, KvReservation,
    LiveRequest, StageTimes, TokenDelta, TransferSample, WorkerInfo, WorkerReport, WorkerRequest, WorkerStats,
)
from actors.protocol.request_status import RequestStatus

SIM_TOKEN = 7  # every generated token


@dataclass(frozen=True)
class SimPages:
    """What a simulated prefill worker pushes instead of pages: the lease and the handoff note."""

    decode_worker: str
    lease_id: str
    note: HandoffNote
    nbytes: int
    sent_at: float


@dataclass
class SimSpec:
    num_blocks: int = 4096
    block_size: int = 16
    kv_bytes_per_token: int = 4096
    prefill_tokens_per_step: int = 8192
    step_s: float = 0.02
    lease_s: float = 30.0


@dataclass
class _Prompt:
    request: WorkerRequest
    hashes: list[int]
    left: int  # prompt tokens still to compute
    cached: int
    received: float
    received_wall: float


@dataclass
class _Decoding:
    request: WorkerRequest
    emitted: int  # output tokens so far
    blocks: int
    cached: int


class SimWorker:
    def __init__(self, worker_id: str, role: str, spec: SimSpec, endpoint: str, incarnation: str, hasher):
        if role not in ("prefill", "decode"):
            raise ValueError(f"a simulated worker is a prefill or a decode worker, not {role!r}")
        self.worker_id, self.role, self.spec, self.incarnation = worker_id, role, spec, incarnation
        self._endpoint, self._hasher = endpoint, hasher
        self.command_endpoint = ""  # its host's command port, once the host has opened it
        self.alive = True
        self._used = 0  # blocks held by requests (prompts, held pages, reservations, decodes)
        self._cache: OrderedDict[int, None] = OrderedDict()  # prefix blocks, least recently used first
        self._prompts: deque[_Prompt] = deque()
        self._held: dict[AttemptId, tuple[WorkerRequest, int]] = {}  # prefill: pages sent, kept until released
        self._reserved: dict[str, tuple[WorkerRequest, int, float]] = {}  # lease id -> (request, blocks, since)
        self._decoding: dict[AttemptId, _Decoding] = {}
        self._finished: list[FinishedAttempt] = []
        self._events: list = []
        self._received: list[AttemptId] = []
        self._waits: list[FirstTokenWait] = []
        self._handed_off: list[HandedOff] = []
        self._transfers: list[TransferSample] = []
        self._leases = 0
        self.sent = self.adopted = self.late_pages = 0

    def info(self) -> WorkerInfo:
        endpoints = (KvRankEndpoint(self._endpoint, 0, 1, 1),) if self.role == "decode" else ()
        s = self.spec
        return WorkerInfo(self.worker_id, self.role, endpoints, s.num_blocks, s.block_size, s.kv_bytes_per_token,
                          self.incarnation, self.command_endpoint)

    # ---- the scheduler's commands ----

    def submit(self, request: WorkerRequest, now: float, wall: float) -> None:
        self._received.append(request.attempt)
        req = request.request
        hashes = self._hasher(req.prompt_token_ids, req.cache_salt)
        hit = 0
        for h in hashes:
            if h not in self._cache:
                break
            self._cache.move_to_end(h)
            hit += 1
        cached = min(hit * self.spec.block_size, len(req.prompt_token_ids) - 1)
        self._prompts.append(_Prompt(request, hashes, len(req.prompt_token_ids) + len(req.output_prefix) - cached,
                                     cached, now, wall))

    def reserve(self, request: WorkerRequest, now: float) -> KvReservation | None:
        blocks = self._blocks(len(request.request.prompt_token_ids))
        if not self._take(blocks):
            return None
        self._leases += 1
        lease = f"{self.worker_id}:{self._leases}"
        self._reserved[lease] = (request, blocks, now)
        return KvReservation(lease, tuple(range(blocks)))

    def release(self, attempt: AttemptId) -> None:
        self._used -= self._held.pop(attempt, (None, 0))[1]

    def abort(self, attempt: AttemptId) -> None:
        self.release(attempt)
        for lease, (request, blocks, _) in list(self._reserved.items()):
            if request.attempt == attempt:
                del self._reserved[lease]
                self._used -= blocks
        decoding = self._decoding.pop(attempt, None)
        if decoding is not None:
            self._used -= decoding.blocks
        for prompt in list(self._prompts):
            if prompt.request.attempt == attempt:
                self._prompts.remove(prompt)

    def pages(self, pages: SimPages, now: float) -> None:
        """A prefill worker's handoff landed: adopt it into the decode batch."""
        held = self._reserved.pop(pages.lease_id, None)
        if held is None:
            self.late_pages += 1  # released (aborted, expired) before the pages came
            return
        request, blocks, _ = held
        self._decoding[request.attempt] = _Decoding(request, 1, blocks, pages.note.num_cached_tokens)
        self._store(self._hasher(request.request.prompt_token_ids, request.request.cache_salt))
        self._handed_off.append(HandedOff(request.attempt, pages.note.prefill_worker))
        self._transfers.append(TransferSample(pages.note.prefill_worker, pages.nbytes, max(now - pages.sent_at, 0.0)))
        self.adopted += 1

    # ---- one step ----

    def step(self, now: float, wall: float, deltas: dict[str, list[TokenDelta]],
             sends: list[tuple[str, SimPages]]) -> None:
        """Advance prefills by the step's token budget and every decode by one token."""
        for d in list(self._decoding.values()):
            self._emit(d, deltas)
        budget = self.spec.prefill_tokens_per_step
        while self._prompts and budget > 0:
            prompt = self._prompts[0]
            took = min(prompt.left, budget)
            prompt.left -= took
            budget -= took
            if prompt.left > 0:
                break
            self._prompts.popleft()
            self._prefilled(prompt, now, wall, deltas, sends)
        for lease, (request, blocks, since) in list(self._reserved.items()):
            if now - since > self.spec.lease_s:  # as a real worker: the client may continue it elsewhere
                del self._reserved[lease]
                self._used -= blocks
                self._finished.append(FinishedAttempt(request.attempt, RequestStatus.FAILED))
                req = request.request
                deltas.setdefault(req.sink, []).append(TokenDelta(
                    request.attempt, 0, 0, (), RequestStatus.FAILED, len(req.prompt_token_ids), 0,
                    f"KV for {request.attempt} did not arrive within the {self.spec.lease_s}s lease", retryable=True))

    def _prefilled(self, prompt: _Prompt, now: float, wall: float, deltas, sends) -> None:
        request = prompt.request
        req = request.request
        blocks = self._blocks(len(req.prompt_token_ids) + len(req.output_prefix))
        self._store(prompt.hashes)
        self._waits.append(FirstTokenWait(request.attempt, now - prompt.received))
        if request.dest is not None:  # a prefill worker: the first token, then the handoff
            self._take(blocks, force=True)
            self._held[request.attempt] = (request, blocks)
            # The stamps let a client tell time spent in this worker from time spent getting here.
            first = TokenDelta(request.attempt, 0, 0, (SIM_TOKEN,), RequestStatus.DECODING, len(req.prompt_token_ids),
                               prompt.cached, times=StageTimes(received=prompt.received_wall, first_token=wall))
            deltas.setdefault(req.sink, []).append(first)
            note = HandoffNote(SIM_TOKEN, prompt.cached, self.worker_id)
            nbytes = blocks * self.spec.block_size * self.spec.kv_bytes_per_token
            sends.append((request.dest.endpoints[0].endpoint,
                          SimPages(request.dest.decode_worker, request.dest.reservation.lease_id, note, nbytes,
                                   time.time())))
            self.sent += 1
            return
        # The whole request runs here (a migration, n > 1, a local prefill): it decodes on.
        self._take(blocks, force=True)
        d = _Decoding(request, len(req.output_prefix), blocks, prompt.cached)
        self._decoding[request.attempt] = d
        self._emit(d, deltas)

    def _emit(self, d: _Decoding, deltas: dict[str, list[TokenDelta]]) -> None:
        req = d.request.request
        offset = d.emitted
        d.emitted += 1
        done = d.emitted >= req.params.max_tokens
        status = RequestStatus.FINISHED_LENGTH if done else RequestStatus.DECODING
        deltas.setdefault(req.sink, []).append(
            TokenDelta(d.request.attempt, 0, offset, (SIM_TOKEN,), status, len(req.prompt_token_ids), d.cached))
        if done:
            del self._decoding[d.request.attempt]
            self._used -= d.blocks
            self._finished.append(FinishedAttempt(d.request.attempt, RequestStatus.FINISHED_LENGTH))

    # ---- blocks and the prefix cache ----

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.spec.block_size)

    def _take(self, blocks: int, force: bool = False) -> bool:
        """Blocks for a request, evicting cached prefix blocks as needed; `force`: the scheduler committed
        them already (a prefill worker is not admission-controlled: it evicts what it must)."""
        while self._used + len(self._cache) + blocks > self.spec.num_blocks and self._cache:
            evicted, _ = self._cache.popitem(last=False)
            self._events.append(BlockRemoved(evicted))
        if not force and self._used + blocks > self.spec.num_blocks:
            return False
        self._used += blocks
        return True

    def _store(self, hashes: list[int]) -> None:
        for i, h in enumerate(hashes):
            if h in self._cache:
                self._cache.move_to_end(h)
                continue
            if self._used + len(self._cache) >= self.spec.num_blocks:
                if not self._cache:
                    return
                evicted, _ = self._cache.popitem(last=False)
                self._events.append(BlockRemoved(evicted))
            self._cache[h] = None
            self._events.append(BlockStored(h, hashes[i - 1] if i else None, self.spec.block_size))

    # ---- reporting ----

    def report(self, rss_bytes: int) -> WorkerReport:
        s = self.spec
        queued = sum(p.left for p in self._prompts)
        stats = WorkerStats(
            self.worker_id, self.role, max(s.num_blocks - self._used - len(self._cache), 0), s.num_blocks,
            self._used, len(self._decoding), len(self._prompts), queued, 0, len(self._reserved), len(self._held), 0,
            len(self._decoding) + len(self._prompts) + len(self._reserved) + len(self._held), 0, 0, 0.0,
            self.sent, 0, self.late_pages, self.adopted, 0, rss_bytes, s.step_s, s.step_s / s.prefill_tokens_per_step)
        report = WorkerReport(self.worker_id, stats, tuple(self._finished), tuple(self._events), tuple(self._waits),
                              tuple(self._received), tuple(self._transfers), tuple(self._handed_off))
        self._finished, self._events, self._waits, self._received = [], [], [], []
        self._transfers, self._handed_off = [], []
        return report

    def live(self) -> list[LiveRequest]:
        running = [LiveRequest(HandoffPhase.RUNNING, p.request) for p in self._prompts]
        running += [LiveRequest(HandoffPhase.RUNNING, d.request) for d in self._decoding.values()]
        reserved = [LiveRequest(HandoffPhase.RESERVED, r) for r, _, _ in self._reserved.values()]
        return running + reserved + [LiveRequest(HandoffPhase.HELD, r) for r, _ in self._held.values()]

    def check_integrity(self) -> None:
        held = (sum(b for _, b in self._held.values()) + sum(b for _, b, _ in self._reserved.values())
                + sum(d.blocks for d in self._decoding.values()))
        if held != self._used:
            raise RuntimeError(f"simulated worker {self.worker_id}: {self._used} blocks in use, requests hold {held}")
