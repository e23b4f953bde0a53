"""OpenAI Responses API request bodies (pydantic), translated into the chat request the OpenAI
chat route builds, so all three APIs share one path (chat_requests.py).

The translation, item by item:

- `instructions` becomes the first, system, message (it is not carried over by
  `previous_response_id`, as OpenAI documents);
- `input` as a string is one user message; as a list, `message` items (roles user, assistant,
  system, developer; content a string or `input_text` / `output_text` parts) become chat
  messages, `function_call` items the `tool_calls` of the assistant message they follow (a new
  one if none), `function_call_output` items `tool` messages; `reasoning` items of earlier turns
  are accepted and not shown to the chat template (the chat route shows no earlier reasoning);
- function `tools` (flat: name, description, parameters) and `tool_choice` none / auto /
  required / {type: function, name} map one to one; `text.format` json_schema / json_object is
  chat's `response_format` (guided decoding);
- `max_output_tokens` is `max_tokens`; `reasoning.effort` `none` turns the template's
  `enable_thinking` off, `medium` (the default) leaves the template's own choice; ifb's
  `max_reasoning_tokens` is the chat route's reasoning budget.

Unknown fields are refused (400, naming them); so are the fields OpenAI defines whose behaviour
this server does not have (built-in tools, `background`, `conversation`, `prompt`,
`max_tool_calls`, `truncation: auto`, logprobs, graded reasoning effort), each by name.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ifb.runtime.errors import AdmissionError
from ifb.runtime.server.openai_protocol import ChatCompletionRequest, chat_request_from


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only verbosity a local model has


class ReasoningConfig(_Strict):
    # Effort is not graded here: `none` turns thinking off, `medium` leaves the template's default.
    effort: Literal["none", "medium"] | None = None
    summary: Literal["auto"] | None = None  # `auto`: the server's choice, the reasoning text itself
    generate_summary: Literal["auto"] | None = None  # the deprecated name of `summary`


class StreamOptions(_Strict):
    include_obfuscation: Literal[False] | None = None  # no obfuscation padding is sent


# The values of `include` this server can honour: encrypted reasoning would carry earlier
# reasoning between stateless turns, and earlier reasoning is not shown to the template anyway.
Includable = Literal["reasoning.encrypted_content"]


class ResponsesRequest(_Strict):
    """`POST /v1/responses`."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[Includable] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None  # no effect, as on the chat route
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache is automatic: a routing hint, nothing more
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None  # `auto` (dropping earlier turns) is not done
    # ifb's, as on the chat route: the tokens the reply's think block may hold (--reasoning-parser)
    max_reasoning_tokens: int | None = Field(default=None, ge=0)
    # OpenAI's fields that change behaviour this server does not have: declared to be refused by name.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        refusals = {
            "background": "background responses are not supported (send stream: true to follow a long reply)",
            "conversation": "conversation objects are not supported; use previous_response_id or send the input",
            "prompt": "prompt templates are not supported; send instructions and input",
            "max_tool_calls": "max_tool_calls is not supported (parallel_tool_calls: false makes at most one call)",
            "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
        }
        for field, message in refusals.items():
            value = getattr(self, field)
            if value is not None and value is not False and not (field == "top_logprobs" and value == 0):
                raise AdmissionError(message, field=field)

    def chat_request(self, earlier: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this body means, after the `earlier` items of a previous response
        (AdmissionError names the Responses field)."""
        self.refuse_unsupported()
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        messages += chat_messages(earlier, "previous_response_id") + chat_messages(items, "input")
        if not messages:
            raise AdmissionError("input has no messages", field="input")
        fields: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p", "parallel_tool_calls", "max_reasoning_tokens"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.tools:
            fields["tools"] = [_function(tool, f"tools.{i}") for i, tool in enumerate(self.tools)]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        format_ = self.text.format if self.text is not None else None
        if format_ is not None and format_.type != "text":
            fields["response_format"] = _response_format(format_)
        if self.reasoning is not None and self.reasoning.effort == "none":
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        return chat_request_from(fields, {"max_tokens": "max_output_tokens"})


def chat_messages(items: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """Responses input items as chat messages; an item this server cannot read is refused."""
    chat: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"{field}.{index}"
        if not isinstance(item, dict):
            raise AdmissionError(f"{where}: each input item must be an object", field=where)
        kind = item.get("type", "message")
        if kind == "message":
            chat.append(_message(item, where))
        elif kind == "function_call":
            _attach_call(chat, item, where)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            chat.append({"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), where)})
        elif kind != "reasoning":  # earlier reasoning is not shown to the template
            raise AdmissionError(f"{where}: input items of type {kind!r} are not supported", field=f"{where}.type")
    return chat


# An earlier reply's text comes back as output_text; what the client writes is input_text.
_PART_TYPES = {"assistant": ("output_text", "input_text")}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise AdmissionError(f"{where}.role must be user, assistant, system or developer", field=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise AdmissionError(f"{where}.content must be a string or a list of parts", field=f"{where}.content")
    allowed = _PART_TYPES.get(role, ("input_text",))
    pieces = []
    for j, part in enumerate(content):
        at = f"{where}.content.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed:
            raise AdmissionError(f"{at}: content parts of type {kind!r} are not supported in {role} messages", field=at)
        pieces.append(_string(part, "text", at))
    return {"role": role, "content": "".join(pieces)}


def _attach_call(chat: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A call joins the assistant turn it follows: the message before it, or earlier calls."""
    arguments = _string(item, "arguments", where)
    try:
        json.loads(arguments)
    except ValueError:
        raise AdmissionError(f"{where}.arguments must be a JSON string", field=f"{where}.arguments") from None
    call = {"id": _string(item, "call_id", where), "type": "function"}
    call["function"] = {"name": _string(item, "name", where), "arguments": arguments}  # type: ignore[assignment]
    if not chat or chat[-1]["role"] != "assistant":
        chat.append({"role": "assistant", "content": None})
    chat[-1].setdefault("tool_calls", []).append(call)


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
        return "".join(_string(p, "text", f"{where}.output") for p in output)
    raise AdmissionError(f"{where}.output must be a string or input_text parts", field=f"{where}.output")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise AdmissionError(f"{where}.{key} must be a string", field=f"{where}.{key}")
    return value


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind != "function":
        raise AdmissionError(
            f"{where}: built-in tools ({kind!r}) are not supported by this server; only function tools",
            field=f"{where}.type",
        )
    try:
        parsed = FunctionTool.model_validate(tool)
    except ValidationError as error:
        first = error.errors()[0]
        at = ".".join([where, *(str(p) for p in first.get("loc", ()))])
        raise AdmissionError(f"{at}: {first.get('msg', 'invalid value')}", field=at) from None
    function = parsed.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _response_format(format_: TextFormat) -> dict[str, Any]:
    if format_.type == "json_object":
        return {"type": "json_object"}
    if format_.schema_ is None or format_.name is None:
        raise AdmissionError("text.format json_schema needs name and schema", field="text.format")
    schema = {"name": format_.name, "schema": format_.schema_, "strict": format_.strict}
    return {"type": "json_schema", "json_schema": schema}
