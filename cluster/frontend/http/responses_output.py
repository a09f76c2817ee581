"""The output items of one Responses answer, and the stream events that build them, from the chat deltas
of its text: content becomes an output `message` item (`output_text`), each tool call a `function_call`
item, in the order the model wrote them.

One builder serves both forms of an answer: a streamed one feeds each event's delta as it comes and sends
the events it gets back; a whole one feeds its whole answer once and keeps only the items, so both are
the same by construction (as chat's streamed and whole tool calls are: tool_call_stream.py).

A message item is opened by its first content (or at once, `eager_message`, for an answer without tools:
its stream then starts with the empty message as before), and closed when a call starts or the answer
ends; a call's item is opened by the delta that names it, its arguments streamed as
`response.function_call_arguments.delta`, and closed by the next call or the end. Events carry no
`sequence_number`: the route numbers everything it sends.
"""

from __future__ import annotations

import uuid


def message_item(msg_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


class ResponseOutput:
    def __init__(self, eager_message: bool, logprobs: bool = False):
        """`logprobs`: the message's text part carries its tokens' logprobs (`include`)."""
        self.items: list[dict] = []  # every item opened so far, in output order (the open one last)
        self._open: dict | None = None  # the item being written
        self._eager, self._logprobs = eager_message, logprobs

    def start(self) -> list[dict]:
        return self._open_message() if self._eager else []

    def feed(self, delta: dict | None, logprobs: list[dict] | None = None) -> list[dict]:
        """The events for the answer's next chat delta (`content`, and/or `tool_calls` pieces); `logprobs`:
        its tokens' (chat's logprobs entries), when they were asked for."""
        events: list[dict] = []
        if not delta and not logprobs:
            return events
        delta = delta or {}
        if delta.get("content") or (self._logprobs and logprobs):
            if self._open is None or self._open["type"] != "message":
                events += self._close() + self._open_message()
            part = self._open["content"][0]
            part["text"] += delta.get("content", "")
            if self._logprobs:
                part["logprobs"] += logprobs or []
            events.append({"type": "response.output_text.delta", "item_id": self._open["id"],
                           "output_index": len(self.items) - 1, "content_index": 0,
                           "delta": delta.get("content", ""), "logprobs": logprobs or []})
        for piece in delta.get("tool_calls") or ():
            function = piece.get("function") or {}
            if piece.get("id") is not None:  # a new call: its name is known
                events += self._close()
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece["id"],
                        "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self._open = item
                events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                               "item": dict(item)})
            if function.get("arguments") and self._open is not None and self._open["type"] == "function_call":
                self._open["arguments"] += function["arguments"]
                events.append({"type": "response.function_call_arguments.delta", "item_id": self._open["id"],
                               "output_index": len(self.items) - 1, "delta": function["arguments"]})
        return events

    def finish(self) -> list[dict]:
        """The events that close the answer's last item."""
        return self._close()

    @property
    def text(self) -> str:
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")

    @property
    def made_calls(self) -> bool:
        return any(item["type"] == "function_call" for item in self.items)

    def _open_message(self) -> list[dict]:
        item = message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
        if self._logprobs:
            item["content"][0]["logprobs"] = []
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        return [{"type": "response.output_item.added", "output_index": index, "item": {**item, "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                 "content_index": 0, "part": _copy(item)["content"][0]}]

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = self.items.index(item)
        if item["type"] == "message":
            part = item["content"][0]
            return [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                     "content_index": 0, "text": part["text"], "logprobs": part.get("logprobs", [])},
                    {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                     "content_index": 0, "part": dict(part)},
                    {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}]
        if not item["arguments"]:
            item["arguments"] = "{}"  # a call without arguments (chat's reader gives `{}` the same way)
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}]


def _copy(item: dict) -> dict:
    return {**item, "content": [{**part, **({"logprobs": list(part["logprobs"])} if "logprobs" in part else {})}
                                for part in item["content"]]}
