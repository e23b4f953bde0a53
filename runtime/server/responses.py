"""OpenAI response shaping: completion and chat bodies, stream chunks, logprobs, tool calls and usage."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ifb.runtime.outputs import RequestOutput, TokenLogprob
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.tools import TOOL_CALL_OPEN, ToolPlan

TokenText = Callable[[int], str]


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response: its index, which prompt it answers, and its parameters."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What every body and chunk of one response shares."""

    response_id: str
    created: int
    model: str
    chat: bool
    token_text: TokenText
    tools: ToolPlan | None = None

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        payload = {
            "id": self.response_id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(payload)}\n\n"

    def role_chunk(self, index: int) -> str:
        return self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def error_event(self, output: RequestOutput) -> str:
        """A request that failed mid-stream: its client gets this event, not a silent stop."""
        error = {"message": output.error or "request failed", "type": "server_error", "code": "request_failed"}
        return f"data: {json.dumps({'error': error})}\n\n"

    def stream_for(self, choice: Choice) -> ChoiceStream:
        return ChoiceStream(self, choice)

    def logprobs(self, choice: Choice, outputs: list[RequestOutput]) -> dict[str, Any] | None:
        if choice.params.logprobs is None:
            return None
        return logprobs_block([lp for o in outputs for lp in o.logprobs], self.chat, self.token_text)

    def final_body(self, choices: list[Choice], results: list[list[RequestOutput]]) -> dict[str, Any]:
        bodies = [self._final_choice(choice, outputs) for choice, outputs in zip(choices, results, strict=True)]
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": bodies,
            "usage": usage(choices, results),
        }

    def _final_choice(self, choice: Choice, outputs: list[RequestOutput]) -> dict[str, Any]:
        text = "".join(o.new_text for o in outputs)
        reason = outputs[-1].finish_reason.value if outputs and outputs[-1].finish_reason else None
        logprobs = self.logprobs(choice, outputs)
        if not self.chat:
            return {"index": choice.index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        content, calls = self.tools.parse(text) if self.tools is not None else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls"
        return {"index": choice.index, "message": message, "finish_reason": reason, "logprobs": logprobs}


@dataclass(slots=True)
class ChoiceStream:
    """Turns one choice's deltas into SSE chunks. With tools, text that may be (part of) a tool
    call is held back: `<tool_call>` blocks in `auto` mode, the whole reply when a call is forced."""

    shape: ResponseShape
    choice: Choice
    held: str = ""
    shown: list[str] = field(default_factory=list)

    def chunks(self, output: RequestOutput) -> list[str]:
        reason = output.finish_reason.value if output.finished and output.finish_reason else None
        logprobs = self.shape.logprobs(self.choice, [output])
        if not self.shape.chat:
            body = {"index": self.choice.index, "text": output.new_text, "finish_reason": reason, "logprobs": logprobs}
            return [self.shape.chunk([body])]
        visible = self._visible(output.new_text)
        self.shown.append(visible)
        out = []
        if visible or logprobs is not None or not output.finished:
            delta = {"content": visible} if visible or not output.finished else {}
            out.append(self._chunk(delta, None, logprobs))
        if output.finished:
            out.append(self._final_chunk(reason))
        return [c for c in out if c]

    def _visible(self, new_text: str) -> str:
        """The text safe to show now; the rest waits for the tool parser at the end."""
        tools = self.shape.tools
        if tools is None or tools.mode == "none":
            return new_text
        if tools.mode != "auto" or TOOL_CALL_OPEN in self.held + new_text:
            self.held += new_text
            return ""
        pending = self.held + new_text
        keep = _partial_marker_length(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _final_chunk(self, reason: str | None) -> str:
        tools = self.shape.tools
        if tools is None or tools.mode == "none":
            return self._chunk({}, reason, None)
        content, calls = tools.parse(self.held)  # what was held back: calls, or plain text after all
        delta: dict[str, Any] = {}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            reason = "tool_calls"
        if content:
            delta["content"] = content
        return self._chunk(delta, reason, None)

    def _chunk(self, delta: dict[str, Any], reason: str | None, logprobs: dict[str, Any] | None) -> str:
        body = {"index": self.choice.index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        return self.shape.chunk([body])


def _partial_marker_length(text: str) -> int:
    """How many trailing characters could be the start of `<tool_call>`."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


def logprobs_block(entries: list[TokenLogprob], chat: bool, token_text: TokenText) -> dict[str, Any] | None:
    """OpenAI's logprobs shapes, with token text (and, for chat, its UTF-8 bytes)."""
    if not entries:
        return None
    if chat:
        return {
            "content": [
                {
                    **_token(e.token_id, token_text),
                    "logprob": e.logprob,
                    "top_logprobs": [{**_token(t, token_text), "logprob": v} for t, v in e.top.items()],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [token_text(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t): v for t, v in e.top.items()} for e in entries],
    }


def _token(token_id: int, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def usage(choices: list[Choice], results: list[list[RequestOutput]]) -> dict[str, int]:
    """Each prompt counts once, however many choices (n) answer it."""
    prompts = {c.prompt_index: len(c.prompt_token_ids) for c in choices}
    prompt_tokens = sum(prompts.values())
    completion = sum(r[-1].num_output_tokens for r in results if r)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def first_error(results: list[list[RequestOutput]]) -> str | None:
    """The error of the first choice that failed (finish reason `error`), if any."""
    for outputs in results:
        if outputs and outputs[-1].finish_reason is FinishReason.ERROR:
            return outputs[-1].error or "request failed"
    return None
