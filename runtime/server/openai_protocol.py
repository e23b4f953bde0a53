"""OpenAI-compatible request bodies (pydantic) and their mapping onto SamplingParams."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

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
from ifb.runtime.server.tools import Tool, ToolChoice, ToolPlan, plan_tools


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` field: the same constraints as its older guided_* fields."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def constraints(self) -> list[GuidedDecoding]:
        field = "structured_outputs"
        given = []
        if self.json_schema is not None:
            given.append(GuidedDecoding.json_schema(self.json_schema, field=f"{field}.json"))
        if self.regex is not None:
            given.append(GuidedDecoding.regex(self.regex, field=f"{field}.regex"))
        if self.choice is not None:
            given.append(GuidedDecoding.choice(self.choice, field=f"{field}.choice"))
        if self.grammar is not None:
            given.append(GuidedDecoding.grammar(self.grammar, field=f"{field}.grammar"))
        if self.json_object:
            given.append(GuidedDecoding.json_object(field=f"{field}.json_object"))
        return given


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
    skip_special_tokens: bool = True  # False: special tokens' text is in the reply
    # guided decoding: OpenAI's response_format and vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer name for the guided_* fields

    def guided(self) -> GuidedDecoding | None:
        """At most one constraint; AdmissionError names the field otherwise."""
        given = [] if self.structured_outputs is None else self.structured_outputs.constraints()
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(GuidedDecoding.json_object())
        elif rf is not None and rf.type == "json_schema":
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
                "give at most one of response_format, structured_outputs, guided_json, guided_regex, "
                "guided_grammar, guided_choice, tool_choice (required or a named function)",
                field=given[1].field,
            )
        return given[0] if given else None

    def logprobs_count(self) -> int | None:
        return None

    def sampling_params(self, index: int = 0) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        bias = {_token_key(key): value for key, value in (self.logit_bias or {}).items()}
        seed = None if self.seed is None else self.seed + index  # n > 1: distinct, reproducible
        if seed is not None and seed > SEED_MAX:
            raise AdmissionError(
                f"seed + n - 1 must stay <= {SEED_MAX} (each choice samples with seed + its index)", field="seed"
            )
        return SamplingParams(
            **{name: getattr(self, name) for name in _SAME_NAMED},
            logit_bias=bias,
            seed=seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=self.logprobs_count(),
            guided=self.guided(),
        )


# The SamplingParams fields a body carries as they are, under the same name; the converted ones
# are passed by sampling_params itself.
_CONVERTED = {"logit_bias", "seed", "stop", "stop_token_ids", "logprobs", "guided"}
_SAME_NAMED = {f.name for f in dataclasses.fields(SamplingParams)} & _Common.model_fields.keys() - _CONVERTED


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

    def for_template(self, index: int) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        extra = self.model_extra or {}
        if self.role == "assistant" and extra.get("tool_calls"):
            message["tool_calls"] = [_call_for_template(call, index) for call in extra["tool_calls"]]
        if self.role == "tool" and extra.get("tool_call_id") is not None:
            message["tool_call_id"] = str(extra["tool_call_id"])
        if self.name is not None:
            message["name"] = self.name
        return message

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
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call comes back (tools.py)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables (enable_thinking)
    # Tokens the reply's <think> block may hold before "</think>" is forced (needs --reasoning-parser).
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    thinking_budget: int | None = Field(default=None, ge=0)  # the same, by Qwen's name

    def reasoning_budget_tokens(self) -> int | None:
        if self.max_reasoning_tokens is not None and self.thinking_budget is not None:
            raise AdmissionError("give max_reasoning_tokens or thinking_budget, not both", field="thinking_budget")
        return self.thinking_budget if self.max_reasoning_tokens is None else self.max_reasoning_tokens

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

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def guided(self) -> GuidedDecoding | None:
        forced = self.tool_plan().guided
        given = super().guided()
        if forced is not None and given is not None:
            raise AdmissionError(
                "tool_choice required or a named function already constrains the reply; drop " + given.field,
                field=given.field,
            )
        return forced or given

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them, tool calls and results included."""
        return [m.for_template(i) for i, m in enumerate(self.messages)]


def _call_for_template(call: Any, index: int) -> dict[str, Any]:
    """An earlier assistant tool call, with its arguments as an object (what templates render)."""
    field = f"messages.{index}.tool_calls"
    try:
        function = call["function"]
        arguments = function.get("arguments", "{}")
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": parsed}}
    except (TypeError, KeyError, ValueError, AttributeError):
        raise AdmissionError(
            f"{field}: each call needs function.name and JSON function.arguments", field=field
        ) from None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt (text or ids) or chat messages."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: StrictStr | list[StrictInt] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


def chat_request_from(fields: dict[str, Any], field_names: dict[str, str] | None = None) -> ChatCompletionRequest:
    """The chat request another API's body translates into (Anthropic's messages, OpenAI's
    responses). Their own models check first; what slips through is an AdmissionError naming the
    field, in the caller's vocabulary (`field_names`: chat field -> the API's name for it)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        for chat_name, own_name in (field_names or {}).items():
            where = where.replace(chat_name, own_name)
        raise AdmissionError(f"{where}: {first.get('msg', 'invalid value')}", field=where or None) from None
