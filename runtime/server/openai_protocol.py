"""OpenAI-compatible request bodies (pydantic) and their mapping onto SamplingParams."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)


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

    # Bounds are part of the schema (so /openapi.json documents them) and checked again by
    # SamplingParams for Python callers; past one, a 400 names the field.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    # vLLM extras
    top_k: int = Field(default=0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
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
        if seed is not None and seed > SEED_MAX:
            raise AdmissionError(
                f"seed + n - 1 must stay <= {SEED_MAX} (each choice samples with seed + its index)", field="seed"
            )
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
    # Strict: `[true, false]` is not a list of token ids.
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def refuse_unsupported(self) -> None:
        """Fields OpenAI defines that ifb does not implement are refused, never ignored."""
        if self.echo:
            raise AdmissionError("echo is not supported by this server", field="echo")
        if self.suffix:
            raise AdmissionError("suffix (insertion) is not supported by this server", field="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise AdmissionError(
                f"best_of must equal n ({self.n}): ranking candidates is not supported", field="best_of"
            )

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or not p or isinstance(p[0], int) else len(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's text; a part that is not text (an image, audio) is refused, not dropped."""
        if not isinstance(self.content, list):
            return self.content or ""
        pieces = []
        for j, part in enumerate(self.content):
            field = f"messages.{index}.content.{j}"
            if part.get("type") != "text":
                raise AdmissionError(
                    f"{field}: content parts of type {part.get('type')!r} are not supported", field=field
                )
            if not isinstance(part.get("text"), str):
                raise AdmissionError(f"{field}.text must be a string", field=f"{field}.text")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def logprobs_count(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise AdmissionError(
                f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top}", field="top_logprobs"
            )
        return (top or 0) if self.logprobs else None

    def refuse_unsupported(self) -> None:
        for index, message in enumerate(self.messages):
            message.text(index)

    @property
    def num_prompts(self) -> int:
        return 1

    def sampling_params(self, index: int = 0) -> SamplingParams:
        if self.max_completion_tokens is not None and self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(index)

    def chat_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]
