"""The progress bound on the client side: a request that hears nothing for half the bound is moved (its
old attempt given up, so none of its late deltas count), and ended with a clean error at the full bound."""

from __future__ import annotations

import time

from actors.protocol.ids import AttemptId
from actors.protocol.messages import GenerateRequest, TokenDelta, WorkerRequest
from actors.protocol.request_status import RequestStatus
from actors.protocol.sampling_params import SamplingParams
from cluster.frontend.request_stream import RequestStream, Stalled


def _stream(n: int = 1) -> RequestStream:
    return RequestStream(GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=4, n=n), "tcp://sink"))


def _delta(attempt: AttemptId, offset: int, token: int) -> TokenDelta:
    return TokenDelta(attempt, 0, offset, (token,), RequestStatus.DECODING, 3, 0)


def test_a_first_stall_moves_the_request_and_its_old_attempt_goes_stale():
    stream, first = _stream(), AttemptId("r", "e:1")
    assert [list(ev.token_ids) for ev in stream.feed(_delta(first, 0, 7))] == [[7]]
    assert stream.feed(Stalled(60.0)) == [] and stream.migration_pending
    assert stream.migration_request().output_prefix == (7,)
    assert stream.feed(_delta(first, 1, 8)) == []  # the given-up attempt's late token
    assert [list(ev.token_ids) for ev in stream.feed(_delta(AttemptId("r", "e:2"), 1, 9))] == [[9]]
    assert not stream.finished


def test_a_second_stall_ends_the_request_with_a_clean_error():
    stream = _stream()
    stream.feed(Stalled(60.0))
    stream.migration_request()
    (event,) = stream.feed(Stalled(60.0))
    assert event.finished and event.finish_reason == "error" and "the progress bound is 60s" in event.error
    assert stream.finished and stream.needs_abort


def test_a_request_that_cannot_move_ends_at_its_first_stall():
    stream = _stream(n=2)  # several samples are never migrated
    events = stream.feed(Stalled(30.0))
    assert [ev.finish_reason for ev in events] == ["error", "error"] and not stream.migration_pending


def test_the_checks_fall_at_half_the_bound_then_at_the_bound_counted_from_the_last_progress():
    stream, attempt = _stream(), AttemptId("r", "e:1")
    stream.feed(_delta(attempt, 0, 7))
    assert stream.next_stall_check(60.0) == stream.last_progress + 30.0
    stream.feed(Stalled(60.0))
    # the move is no progress; the last check comes just before the bound, for the error to reach the client in it
    assert stream.last_progress + 59.0 <= stream.next_stall_check(60.0) < stream.last_progress + 60.0


def test_a_stall_found_late_ends_the_request_at_once():
    stream = _stream()
    stream.last_progress -= 61.0  # its pump was held up past the whole bound
    (event,) = stream.feed(Stalled(60.0))
    assert event.finish_reason == "error" and not stream.migration_pending


def test_progress_after_a_move_lets_a_later_stall_move_it_again():
    stream, first, second = _stream(), AttemptId("r", "e:1"), AttemptId("r", "e:2")
    stream.feed(_delta(first, 0, 7))
    stream.feed(Stalled(60.0))
    assert stream.migration_request().output_prefix == (7,)
    assert [list(ev.token_ids) for ev in stream.feed(_delta(second, 1, 8))] == [[8]]  # the moved attempt progresses
    assert stream.next_stall_check(60.0) == stream.last_progress + 30.0
    assert stream.feed(Stalled(60.0)) == [] and stream.migration_pending
    assert stream.feed(_delta(first, 2, 9)) == [] and stream.feed(_delta(second, 2, 9)) == []  # both given up


def test_a_lost_worker_is_no_progress_the_client_sees():
    """A retryable failure moves the request but brings the client nothing: its silence goes on counting
    toward the bound (seen under crash loops: streams silent 66 s against a 60 s bound)."""
    stream, first = _stream(), AttemptId("r", "e:1")
    stream.feed(_delta(first, 0, 7))
    heard = stream.last_progress
    lost = TokenDelta.failure(WorkerRequest(first, stream.request), "worker lost", retryable=True)
    assert stream.feed(lost) == [] and stream.migration_pending
    assert stream.last_progress == heard


def test_an_attempt_the_scheduler_placed_again_goes_stale_without_a_move():
    """Its prefill worker was declared lost while only stalled: the scheduler prefills the request again and
    says the old attempt is stale, so the old one's first token (the stalled worker woke and finished its
    step) is neither shown nor counted, and the client does not move the request itself."""
    stream, old, new = _stream(), AttemptId("r", "e:1"), AttemptId("r", "e:2")
    assert stream.feed(TokenDelta.stale(old)) == [] and not stream.migration_pending
    assert stream.feed(_delta(old, 0, 7)) == []
    assert [list(ev.token_ids) for ev in stream.feed(_delta(new, 0, 8))] == [[8]]
    assert (stream.received_tokens, stream.moves) == (1, 0)


def test_the_bound_counts_the_admission_wait():
    """A request admitted after a long wait has only what is left of the bound (its silence began when it
    was sent, not when it was admitted)."""
    sent = time.monotonic() - 61.0
    stream = RequestStream(GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), "tcp://sink"), started=sent)
    assert stream.next_stall_check(60.0) == sent + 30.0
    (event,) = stream.feed(Stalled(60.0))
    assert event.finish_reason == "error" and not stream.migration_pending


def test_inbox_bounds_a_slow_reader_and_serves_what_arrived_first():
    import asyncio

    from cluster.frontend.inbox import OVERFLOW, Inbox

    async def scenario():
        loop = asyncio.get_running_loop()
        inbox = Inbox(loop, maxsize=2)
        inbox.put("a")
        await asyncio.sleep(0)  # a put from another thread lands on the loop's next turn
        first = await inbox.get(0)  # already there: served even at a timeout of 0
        for item in "bcd":
            inbox.put(item)
        await asyncio.sleep(0)
        overflowed, held = inbox.overflowed, inbox.qsize()
        after = await inbox.get(1)
        inbox.put("e")  # nothing more is taken once it overflowed
        await asyncio.sleep(0)
        try:
            await inbox.get(0.01)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
        return first, overflowed, held, after, timed_out

    first, overflowed, held, after, timed_out = asyncio.run(scenario())
    assert first == "a" and overflowed and held == 1 and after is OVERFLOW and timed_out
