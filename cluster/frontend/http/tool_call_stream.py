"""An answer's tool calls read as it is decoded, so a streamed answer with tools is streamed: its content
goes out as it comes, its calls as OpenAI's `tool_calls` deltas (the first with index, id, type and name,
then the arguments' text piece by piece). The whole answer fed at once gives the non-streamed message,
so both are the same by construction.

Who calls it: `tool_calls.CallReader` makes one `CallStream` per choice; streaming feeds it each event's
text, the last with `last=True`; `CallReader.parse` feeds a whole answer at once.

What it promises:
- Content is held back only while it could still be the start of a call: a suffix that is a prefix of
  hermes' `<tool_call>`, and trailing whitespace (whitespace just before or after a call is dropped, and
  at the end of an answer that made calls). An answer without calls is its text, unchanged.
- A call is made once its object's `name` string has closed (`<tool_call>{"name": ...` for hermes, an
  answer that starts with `{` for llama3_json, the whole answer when a grammar forces the call). Until
  then its text is held; a block that turns out not to be a call is given back as content.
- The arguments are the text the model wrote for the `arguments` (llama3_json: `parameters`) object,
  sent as it is decoded; arguments written as a string holding a JSON object are that string, and any
  other value goes out as JSON when it is complete. A call without arguments gets `{}`. A call cut short
  by max_tokens keeps the arguments written so far (as OpenAI's), and its finish reason stays "length".
- `one` (parallel_tool_calls: false): calls after the first are read and dropped.
"""

from __future__ import annotations

import json
import uuid

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class _CallObject:
    """One call object `{"name": ..., "arguments": ...}` read character by character, from its `{`."""

    def __init__(self, argument_keys: tuple[str, ...]):
        self.text = ""
        self.argument_keys = argument_keys
        self.depth, self.in_string, self.escaped = 0, False, False
        self.phase = "key"  # at the top level: "key", "colon", "value", "after" (a value is complete)
        self.key: str | None = None
        self.start: int | None = None  # where the current top-level key or value starts
        self.values: dict[str, str] = {}  # top-level key -> its value's text, once complete
        self.arguments_key: str | None = None
        self.arguments_start: int | None = None
        self.closed = False  # the object ended (its `}`, or text that cannot continue it)

    def push(self, text: str) -> int:
        """Read `text` until the object ends; returns how many characters belong to it."""
        for n, ch in enumerate(text):
            if not self._read(ch):  # not part of the object: it ends before this character
                self.text, self.closed = self.text[:-1], True
                return n
            if self.closed:
                return n + 1
        return len(text)

    def _read(self, ch: str) -> bool:
        i = len(self.text)
        self.text += ch
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 1 and self.phase == "key":
                    self.key, self.phase = _string(self.text[self.start:]), "colon"
                elif self.depth == 1 and self.phase == "value":
                    self._value_end(i + 1)
            return True
        top = self.depth == 1
        if ch.isspace():
            return True
        if top and self.phase == "value" and self.start is None:
            self.start = i
            if self.key in self.argument_keys and self.arguments_key is None:
                self.arguments_key, self.arguments_start = self.key, i
        if ch == '"':
            self.in_string = True
            if top and self.phase == "key":
                self.start = i
            return top is False or self.phase in ("key", "value")
        if ch in "{[":
            self.depth += 1
            return self.depth > 1 and (not top or self.phase == "value") or (self.depth == 1 and ch == "{")
        if ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.phase == "value":
                self._value_end(i + 1)
            elif self.depth == 0:
                if self.phase == "value":
                    self._value_end(i)
                self.closed = True
            return self.depth >= 0
        if not top:
            return True
        if ch == ":" and self.phase == "colon":
            self.phase, self.start = "value", None
            return True
        if ch == "," and self.phase in ("value", "after"):
            if self.phase == "value":
                self._value_end(i)
            self.phase = "key"
            return True
        return self.phase == "value"  # a number, true, false or null

    def _value_end(self, end: int) -> None:
        if self.key is not None and self.start is not None:
            self.values.setdefault(self.key, self.text[self.start:end].rstrip())
        self.phase = "after"

    def name(self) -> str | None:
        return _string(self.values.get("name", ""))

    def arguments(self) -> tuple[str, bool]:
        """(the arguments' text as far as it can be sent, whether it is complete)."""
        if self.arguments_key is None:
            return ("{}", True) if self.closed else ("", False)
        done = self.values.get(self.arguments_key)
        if self.text[self.arguments_start] == "{":  # an object goes out as it is written
            return (done, True) if done is not None else (self.text[self.arguments_start:], False)
        if done is None:
            return ("", self.closed)
        return _wire(done), True


def _string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def _wire(value_text: str) -> str:
    """A non-object arguments value as the client's arguments string: a string holding a JSON object is
    already that (a model copying a history of string arguments writes them so); anything else as JSON."""
    try:
        value = json.loads(value_text)
    except json.JSONDecodeError:
        return value_text
    if isinstance(value, str):
        try:
            if isinstance(json.loads(value), dict):
                return value
        except json.JSONDecodeError:
            pass
    return json.dumps(value, ensure_ascii=False)


class CallStream:
    """One choice's answer read piece by piece; `feed` returns the delta to send (or None)."""

    def __init__(self, parser: str | None, forced: bool, one: bool):
        self.parser = "forced" if forced else parser
        self.one = one
        self.calls: list[dict] = []  # the calls made: {"id", "name", "arguments"} as sent
        self._pending = ""  # content not sent yet
        self._held = ""  # the text of a call not yet made (given back as content if it is none)
        self._state = "object" if forced else "start" if parser == "llama3_json" else "content"
        self._call: _CallObject | None = _CallObject(("arguments",)) if forced else None
        self._index: int | None = None  # the call being read, once it is made
        self._after_call = False
        self._sent_arguments = 0

    def feed(self, text: str, last: bool = False) -> dict | None:
        """The delta for the answer's next `text`; `last`: the answer ends with it, nothing is held."""
        out: dict = {}
        self._read(text, out)
        if last:
            self._finish(out)
        return out or None

    def _finish(self, out: dict) -> None:
        while self._state in ("open", "object") and self._index is None:  # never became a call: content
            self._give_back(out)
            self._read("", out)
        if self._state in ("start", "content"):
            rest = self._pending.rstrip() if self.calls else self._pending
            self._pending = ""
            self._send_content(rest, out)

    def _read(self, text: str, out: dict) -> None:
        self._pending += text
        while True:
            before = (self._state, len(self._pending))
            getattr(self, "_" + self._state)(out)
            if (self._state, len(self._pending)) == before:
                return

    def _start(self, out: dict) -> None:  # llama3_json: an answer that starts with `{` may be the call
        body = self._pending.lstrip()
        if body:
            self._state = "object" if body[0] == "{" else "text"
            if self._state == "object":
                self._held, self._pending = self._pending[:len(self._pending) - len(body)], body
                self._call = _CallObject(("parameters", "arguments"))

    def _text(self, out: dict) -> None:  # an answer that has no call, sent as it comes
        self._send_content(self._pending, out)
        self._pending = ""

    def _content(self, out: dict) -> None:
        if self._after_call:
            self._pending = self._pending.lstrip()
            self._after_call = not self._pending
        at = self._pending.find(_OPEN) if self.parser == "hermes" else -1
        if at >= 0:
            before = self._pending[:at]
            self._send_content(before.rstrip(), out)
            self._held = before[len(before.rstrip()):] + _OPEN
            self._pending = self._pending[at + len(_OPEN):]
            self._state = "open"
            return
        end = len(self._pending) - (_marker_prefix(self._pending) if self.parser == "hermes" else 0)
        end = len(self._pending[:end].rstrip())
        self._send_content(self._pending[:end], out)
        self._pending = self._pending[end:]

    def _open(self, out: dict) -> None:  # after `<tool_call>`: a call is an object
        body = self._pending.lstrip()
        if not body:
            return
        if body[0] != "{":
            self._give_back(out)
            return
        self._held += self._pending[:len(self._pending) - len(body)]
        self._pending = body
        self._call = _CallObject(("arguments",))
        self._state = "object"

    def _object(self, out: dict) -> None:
        call = self._call
        used = call.push(self._pending)
        self._pending = self._pending[used:]
        index = self._index
        if index is None and call.name() is not None:
            index = self._index = len(self.calls)
            self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": call.name(), "arguments": ""})
            self._held, self._sent_arguments = "", 0
            if self._sends(index):
                _tool_delta(out, index, {"id": self.calls[index]["id"], "type": "function",
                                         "function": {"name": call.name(), "arguments": ""}})
        if index is not None:
            text, _ = call.arguments()
            if len(text) > self._sent_arguments:
                piece = text[self._sent_arguments:]
                self._sent_arguments = len(text)
                self.calls[index]["arguments"] += piece
                if self._sends(index):
                    _tool_delta(out, index, {"function": {"arguments": piece}})
        if not call.closed:
            return
        if index is None:
            self._give_back(out)
            return
        self._call, self._index = None, None
        self._state = "close" if self.parser == "hermes" else "content"
        self._after_call = True

    def _close(self, out: dict) -> None:  # hermes: the block's `</tool_call>` after its object
        body = self._pending.lstrip()
        if body.startswith(_CLOSE):
            self._pending = body[len(_CLOSE):]
        elif _CLOSE.startswith(body):
            return
        self._state = "content"

    def _give_back(self, out: dict) -> None:
        """What looked like a call is not one: its text is content, read again after its first character
        (so a `<tool_call>` inside it can still start a call)."""
        text = self._held + (self._call.text if self._call is not None else "") + self._pending
        self._call, self._held = None, ""
        self._state = "text" if self.parser in ("llama3_json", "forced") else "content"
        cut = len(text) - len(text.lstrip()) + 1
        self._send_content(text[:cut], out)
        self._pending = text[cut:]

    def _sends(self, index: int) -> bool:
        return index == 0 or not self.one

    def _send_content(self, text: str, out: dict) -> None:
        if text:
            out["content"] = out.get("content", "") + text


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that could start `<tool_call>`."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0


def _tool_delta(out: dict, index: int, part: dict) -> None:
    """Adds one call's part to a delta, merged with that call's earlier part in the same delta (clients
    accumulate by index across chunks, not within one)."""
    entries = out.setdefault("tool_calls", [])
    entry = next((e for e in entries if e["index"] == index), None)
    if entry is None:
        entries.append({"index": index, **part})
        return
    for key, value in part.items():
        if key == "function":
            function = entry.setdefault("function", {})
            for k, v in value.items():
                function[k] = function.get(k, "") + v if k == "arguments" else v
        else:
            entry[key] = value
