"""OpenAI-compatible request bodies (pydantic) and their mapping onto SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.sampling_params import SamplingParams


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    # OpenAI rejects unknown arguments; so do we (vLLM's extra sampling fields are declared).
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # guided decoding: OpenAI's response_format and vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    def guided(self) -> GuidedDecoding | None:
        """At most one constraint; AdmissionError names the field otherwise."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            rf = self.response_format
            if rf.type == "json_object":
                given.append(GuidedDecoding.json_object())
            else:
                if rf.json_schema is None or "schema" not in rf.json_schema:
                    raise AdmissionError(
                        "response_format.json_schema.schema is required for type json_schema", field="response_format"
                    )
                given.append(GuidedDecoding.json_schema(rf.json_schema["schema"], field="response_format"))
        if self.guided_json is not None:
            given.append(GuidedDecoding.json_schema(self.guided_json))
        if self.guided_regex is not None:
            given.append(GuidedDecoding.regex(self.guided_regex))
        if self.guided_grammar is not None:
            given.append(GuidedDecoding.grammar(self.guided_grammar))
        if self.guided_choice is not None:
            given.append(GuidedDecoding.choice(self.guided_choice))
        if len(given) > 1:
            raise AdmissionError(
                "give at most one of response_format, guided_json, guided_regex, guided_grammar, guided_choice",
                field=given[1].field,
            )
        return given[0] if given else None

    def logprobs_count(self) -> int | None:
        return None

    def sampling_params(self, index: int = 0) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            bias[_token_key(key)] = value
        seed = None if self.seed is None else self.seed + index  # n > 1: distinct, reproducible
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs_count(),
            cache_salt=self.cache_salt,
            guided=self.guided(),
        )


def _token_key(key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise AdmissionError(f"logit_bias keys must be token ids, got {key!r}", field="logit_bias") from None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def logprobs_count(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, index: int = 0) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(index)

    def chat_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):  # text parts only
                content = "".join(part.get("text", "") for part in content if part.get("type") == "text")
            out.append({"role": m.role, "content": content or ""})
        return out
