"""Responses API output items, built delta by delta with the chat route's reasoning split and
tool-call parsing (responses.py's ChoiceStream), each change written as the streamed event
OpenAI names for it. A reply that is not streamed is built the same way and its events dropped,
so a streamed and a whole reply cannot differ.

The items, in order: a `reasoning` item (the think block, as one `reasoning_text` part; no
summary), a `message` item (one `output_text` part), then one `function_call` item per call.
Each item's events: output_item.added, content_part.added, the text's deltas, its done event,
content_part.done, output_item.done; a call's arguments come as one delta."""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.server.responses import ChoiceStream

ItemKind = Literal["reasoning", "message"]
_PREFIX = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}
# Per kind: the content part's type, and the names of its delta and done events.
_PART = {"reasoning": "reasoning_text", "message": "output_text"}


def new_id(kind: str) -> str:
    return _PREFIX.get(kind, "resp_") + uuid.uuid4().hex


def sse_event(record: dict[str, Any]) -> str:
    return f"event: {record['type']}\ndata: {json.dumps(record, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class ItemStream:
    """One reply's output items and the events that build them. `sequence_number` numbers
    every event of the response, its lifecycle events included (`event`)."""

    parts: ChoiceStream
    output: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    sequence_number: int = 0
    open_kind: ItemKind | None = None
    tokens_before_content: int = 0
    content_started: bool = False
    has_reasoning: bool = False

    def event(self, record: dict[str, Any]) -> str:
        """`record` as an SSE event, with the next sequence number."""
        line = sse_event({**record, "sequence_number": self.sequence_number})
        self.sequence_number += 1
        return line

    def take(self) -> list[str]:
        """The events made since the last take."""
        out, self.events = self.events, []
        return out

    @property
    def reasoning_tokens(self) -> int:
        """The reply's tokens before its first content, when it reasoned: its think block."""
        return self.tokens_before_content if self.has_reasoning else 0

    def feed(self, output: RequestOutput) -> None:
        split = self.parts.reasoning.feed(output.new_text)
        if output.finished:
            split += self.parts.reasoning.finish()
        if not self.content_started:
            self.content_started = bool(split.content)
            self.tokens_before_content += 0 if split.content else len(output.new_token_ids)
        if split.reasoning:
            self.has_reasoning = True
            self._delta("reasoning", split.reasoning)
        visible = self.parts.calls.feed(split.content)
        if visible:
            self._delta("message", visible)

    def finish(self, last: RequestOutput) -> Literal["completed", "incomplete"]:
        """Close the reply: text held back as a possible call, then each call as a function_call
        item. The response's status: incomplete when cut at max_output_tokens short of a call."""
        shape = self.parts.shape
        held = self.parts.calls.finish()
        content, calls = shape.tools.parse(held, shape.tool_parser) if shape.tools is not None else (held, [])
        if content:
            self._delta("message", content)
        if not calls and not self.output:
            self._open("message")  # an empty reply is an empty message
        status: Literal["completed", "incomplete"] = "completed"
        if last.finish_reason is FinishReason.LENGTH and not calls:
            status = "incomplete"
        self._close(status)
        for call in calls:
            self._function_call(call["id"], call["function"]["name"], call["function"]["arguments"])
        return status

    def _delta(self, kind: ItemKind, text: str) -> None:
        if self.open_kind != kind:
            self._open(kind)
        item = self.output[-1]
        item["content"][0]["text"] += text
        where = self._where(item)
        self.events.append(
            self.event({"type": f"response.{_PART[kind]}.delta", **where, "delta": text, **_logprobs(kind)})
        )

    def _open(self, kind: ItemKind) -> None:
        self._close("completed")
        self.open_kind = kind
        item: dict[str, Any] = {"id": new_id(kind), "type": kind, "status": "in_progress", "content": []}
        if kind == "message":
            item["role"] = "assistant"
        else:
            item["summary"] = []
        self.output.append(item)
        self.events.append(self.event({"type": "response.output_item.added", "output_index": len(self.output) - 1,
                                       "item": copy.deepcopy(item)}))  # fmt: skip
        part: dict[str, Any] = {"type": _PART[kind], "text": ""}
        if kind == "message":
            part.update(annotations=[], logprobs=[])
        item["content"].append(part)
        self.events.append(self.event({"type": "response.content_part.added", **self._where(item), "part": dict(part)}))

    def _close(self, status: str) -> None:
        kind = self.open_kind
        if kind is None:
            return
        self.open_kind = None
        item = self.output[-1]
        part, where = item["content"][0], self._where(item)
        done: dict[str, Any] = {
            "type": f"response.{_PART[kind]}.done",
            **where,
            "text": part["text"],
            **_logprobs(kind),
        }
        self.events.append(self.event(done))
        self.events.append(self.event({"type": "response.content_part.done", **where, "part": dict(part)}))
        item["status"] = status
        self._item_done(item)

    def _function_call(self, call_id: str, name: str, arguments: str) -> None:
        item = {"id": new_id("function_call"), "type": "function_call", "status": "in_progress",
                "call_id": call_id, "name": name, "arguments": ""}  # fmt: skip
        self.output.append(item)
        index = len(self.output) - 1
        self.events.append(
            self.event({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        )
        where = {"item_id": item["id"], "output_index": index}
        self.events.append(self.event({"type": "response.function_call_arguments.delta", **where, "delta": arguments}))
        item.update(arguments=arguments, status="completed")
        self.events.append(
            self.event({"type": "response.function_call_arguments.done", **where, "name": name, "arguments": arguments})
        )
        self._item_done(item)

    def _item_done(self, item: dict[str, Any]) -> None:
        index = self.output.index(item)
        self.events.append(self.event({"type": "response.output_item.done", "output_index": index,
                                       "item": copy.deepcopy(item)}))  # fmt: skip

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}


def _logprobs(kind: ItemKind) -> dict[str, Any]:
    """Output text events carry a logprobs list (empty: this route returns none)."""
    return {"logprobs": []} if kind == "message" else {}
