"""Incremental detokenization and stop strings for one request's output stream.

Whoever streams a request's text (the output processor) owns one `IncrementalDetokenizer` per
request: it calls `add_tokens` with each batch of new output ids and sends `new_text` on; when the
request finishes for any reason other than a stop string it calls `flush` once for the rest.

Promises:
- Text is released once and never revised: it holds no incomplete UTF-8 character (a character
  split over byte-level tokens comes out when its last byte arrives) and no text that may still
  turn out to be the start of a stop string.
- `output_text` after `flush` equals `tokenizer.decode(output_ids, skip_special_tokens=...)`,
  including the U+FFFD characters decode writes for invalid UTF-8, for tokenizers whose decode
  of a concatenation is the concatenation of decodes split at character boundaries (byte-level
  BPE such as GPT-2/Llama-3/ours; no `clean_up_tokenization_spaces`). For SentencePiece-style
  tokenizers the last prompt tokens are decoded as context, so the first word keeps the leading
  space it has in context, which a bare `decode(output_ids)` strips.
- Cost per call is one or two `decode`s of a short window: the ids since the last character
  boundary plus the chunk before it, not the whole output. Only a long run of tokens with no
  character boundary between any two of them (invalid bytes, or multi-byte characters split across
  every token) widens the window, and it narrows again at the next boundary.
- Stop strings are matched across token boundaries. The stop string that completes first in the
  text wins (on a tie, the one starting first). Text from the stop string on is dropped
  (`include_stop_str_in_output` keeps the stop string itself), and so is all later text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids decoded in front of the output so the first output token decodes in context.
_PROMPT_CONTEXT = 4
# With this many ids past the last character boundary, look for a boundary among the newest ids
# (only runs of invalid bytes get here); after a miss the next look waits twice as long.
_FIRST_PROBE = 4


@dataclass(frozen=True, slots=True)
class DetokenizeResult:
    new_text: str  # final text, safe to send to the client now
    stop_hit: str | None = None  # the stop string that ended the output, once one has


class StopMatcher:
    """Finds stop strings in text that arrives in chunks, holding back what could start one."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.stops = tuple(dict.fromkeys(stop))
        self.include_stop = include_stop_str_in_output
        self.stop_hit: str | None = None
        self._held = ""  # longest suffix of the text so far that is a proper prefix of a stop
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._max_held = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> str:
        """The part of everything fed so far that can be released now; sets `stop_hit` on a match."""
        if self.stop_hit is not None:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        best: tuple[int, int] | None = None  # (end, start) of the match that completes first
        for s in self.stops:
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best):
                best, self.stop_hit = (start + len(s), start), s
        if best is not None:
            self._held = ""
            return buf[: best[0] if self.include_stop else best[1]]
        keep = self._holdback(buf)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held-back text, at a finish without a match."""
        held, self._held = self._held, ""
        return held

    def _holdback(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._max_held), 0, -1):
            if buf[-k] in self._first_chars:
                tail = buf[-k:]
                if any(s.startswith(tail) for s in self.stops):
                    return k
        return 0


class IncrementalDetokenizer:
    """Turns one request's output ids into text, a batch of ids at a time (see module docstring).

    Window state: `_ids` are the ids from the window start; `_ids[:_read]` end on a character
    boundary (context, already released); of `decode(_ids)`, the first `_released` characters
    have gone to the stop matcher.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._skipped_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stops = StopMatcher(stop, include_stop_str_in_output)
        self.output_text = ""
        self._flushed = False

        context = [int(t) for t in prompt_token_ids[max(0, len(prompt_token_ids) - _PROMPT_CONTEXT):]]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; output bytes must not complete it.
            context, context_text = [], ""
        self._ids = context
        self._read = len(context)
        self._released = len(context_text)
        self._next_probe = _FIRST_PROBE

    @property
    def stop_hit(self) -> str | None:
        return self._stops.stop_hit

    def add_tokens(self, token_ids: Sequence[int]) -> DetokenizeResult:
        if self._flushed:
            raise RuntimeError("add_tokens after flush: the request already finished")
        if self.stop_hit is not None or not token_ids:
            return DetokenizeResult("", self.stop_hit)
        self._ids.extend(int(t) for t in token_ids)
        text = self._decode(self._ids)
        # A trailing U+FFFD may be a character whose last bytes are still to come: hold it back.
        stable = len(text.rstrip(REPLACEMENT_CHAR)) if text.endswith(REPLACEMENT_CHAR) else len(text)
        boundary, head_len = None, 0
        if stable == len(text):
            boundary = len(self._ids)
        elif len(self._ids) - self._read >= self._next_probe:
            boundary, head_len = self._probe_boundary(text)
            if boundary is None:
                self._next_probe *= 2
            else:
                stable = max(stable, head_len)  # the head's U+FFFDs are final: bytes follow them
        fresh = text[self._released:stable]
        self._released = max(self._released, stable)
        if boundary == len(self._ids):
            self._restart_window()
        elif boundary is not None:
            del self._ids[:boundary]
            self._released -= head_len
            self._read = 0
            self._next_probe = _FIRST_PROBE
        return self._release(self._stops.feed(fresh))

    def flush(self) -> str:
        """Everything not yet released, at a finish other than a stop match; "" after a match.

        An unfinished character at the end comes out as the U+FFFD(s) decode writes for it. That
        tail still goes through the stop matcher, so a stop string ending in U+FFFD can match here
        and set `stop_hit`.
        """
        if self._flushed:
            return ""
        self._flushed = True
        if self.stop_hit is not None:
            return ""
        text = self._decode(self._ids)
        rest = self._stops.feed(text[self._released:]) + self._stops.flush()
        self._released = len(text)
        self.output_text += rest
        return rest

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, text: str) -> DetokenizeResult:
        self.output_text += text
        return DetokenizeResult(text, self.stop_hit)

    def _restart_window(self) -> None:
        """All ids end on a character boundary: keep the chunk since the last one as context."""
        self._next_probe = _FIRST_PROBE
        if self._skipped_ids and self._skipped_ids.issuperset(self._ids[self._read:]):
            # Only skipped special tokens since the boundary: decode ignores them, so drop them
            # and keep the old context, which still holds text.
            del self._ids[self._read:]
            return
        del self._ids[: self._read]
        self._read = len(self._ids)
        # Decoded afresh (not sliced from the old window) so tokenizers whose decode depends on
        # what precedes the first id see exactly what later windows will see.
        self._released = len(self._decode(self._ids))

    def _probe_boundary(self, text: str) -> tuple[int | None, int]:
        """A character boundary among the newest ids: (index i, len(decode(_ids[:i]))) or (None, 0).

        Boundary i splits no character when decoding the two sides apart gives the same text as
        decoding them together and the ids after i decode to some text (skipped special tokens
        alone carry no bytes); then no later bytes can reach back across i.
        """
        n = len(self._ids)
        for i in range(n - 1, max(self._read, n - 4), -1):
            head = self._decode(self._ids[:i])
            if not text.startswith(head):
                continue
            tail = self._decode(self._ids[i:])
            if tail and head + tail == text:
                return i, len(head)
        return None, 0
