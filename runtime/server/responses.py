"""OpenAI response shaping: completion and chat bodies, stream chunks, logprobs and usage."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Choice:
    """One choice of a response: its index, prompt and sampling parameters."""

    index: int
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ResponseShape:
    """What every body and chunk of one response shares."""

    response_id: str
    created: int
    model: str
    chat: bool

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

    def delta_chunk(self, choice: Choice, output: RequestOutput) -> str:
        reason = output.finish_reason.value if output.finished and output.finish_reason else None
        logprobs = logprobs_block([output], self.chat) if choice.params.logprobs is not None else None
        body: dict[str, Any] = {"index": choice.index, "finish_reason": reason, "logprobs": logprobs}
        if self.chat:
            body["delta"] = {"content": output.new_text} if output.new_text or not reason else {}
        else:
            body["text"] = output.new_text
        return self.chunk([body])

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
        logprobs = logprobs_block(outputs, self.chat) if choice.params.logprobs is not None else None
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": choice.index, "message": message, "finish_reason": reason, "logprobs": logprobs}
        return {"index": choice.index, "text": text, "finish_reason": reason, "logprobs": logprobs}


def logprobs_block(outputs: list[RequestOutput], chat: bool) -> dict[str, Any] | None:
    entries = [lp for o in outputs for lp in o.logprobs]
    if not entries:
        return None
    if chat:
        return {
            "content": [
                {
                    "token": str(e.token_id),
                    "logprob": e.logprob,
                    "top_logprobs": [{"token": str(t), "logprob": v} for t, v in e.top.items()],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [str(e.token_id) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{str(t): v for t, v in e.top.items()} for e in entries],
    }


def usage(choices: list[Choice], results: list[list[RequestOutput]]) -> dict[str, int]:
    prompt_tokens = sum(len(c.prompt_token_ids) for c in choices)
    completion = sum(r[-1].num_output_tokens for r in results if r)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def first_error(results: list[list[RequestOutput]]) -> str | None:
    """The error of the first choice that failed (finish reason `error`), if any."""
    for outputs in results:
        if outputs and outputs[-1].finish_reason is FinishReason.ERROR:
            return outputs[-1].error or "request failed"
    return None
