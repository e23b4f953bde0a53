"""Anthropic Messages API request bodies (pydantic), translated into the chat request the OpenAI
route builds, so both share one path: chat template, sampling, guided decoding, tool and
reasoning parsers (routes.py, openai_protocol.py, tools.py).

The translation, block by block:

- `system` (a string or text blocks) becomes the first, system, message;
- a user message's text blocks become user messages, its `tool_result` blocks `tool` messages
  (in their order);
- an assistant message's text becomes its content, its `tool_use` blocks its `tool_calls`;
  `thinking` / `redacted_thinking` blocks of earlier turns are accepted and not shown to the
  chat template (the OpenAI route does not show earlier reasoning either);
- `tools` become functions (`input_schema` is the parameters), `tool_choice` auto / any / tool
  / none become auto / required / a named function / none;
- `thinking: {type: enabled, budget_tokens}` becomes the reasoning budget
  (`max_reasoning_tokens`) with `enable_thinking` for the template; `adaptive` turns
  `enable_thinking` on with no budget, `disabled` turns it off.

Unknown fields are refused (400), as on the OpenAI routes; `cache_control` is accepted (the
prefix cache is automatic) and so is `metadata` (it changes nothing, like OpenAI's `user`), and
what the SDK's own reply blocks carry when sent back (`citations`, a `direct` caller).
Images, documents and server tools are refused, naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ifb.runtime.errors import AdmissionError
from ifb.runtime.sampling_params import MAX_STOP_STRINGS, MAX_TOP_K
from ifb.runtime.server.openai_protocol import ChatCompletionRequest, chat_request_from


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # an earlier reply's, echoed back: the text is what counts


class DirectCaller(_Strict):
    type: Literal["direct"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # What the SDK's own blocks carry back: the model called the tool itself, not in a toolset.
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
_ROLE_BLOCKS = {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]

    def blocks(self, index: int) -> list[Block]:
        """The content as blocks; a block this server cannot read is refused, naming it."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return [
            _block(part, f"messages.{index}.content.{j}", _ROLE_BLOCKS[self.role])
            for j, part in enumerate(self.content)
        ]


class AnthropicTool(_Strict):
    type: Literal["custom"] | None = None  # server tools (bash, web_search, ...) are not run here
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)
    display: Literal["summarized"] | None = None  # "omitted" (redacted thinking) is not offered


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """`POST /v1/messages/count_tokens`: what makes the prompt, no sampling."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=128)
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None  # the prefix cache is automatic

    def chat_request(self) -> ChatCompletionRequest:
        """The OpenAI chat request this body means (AdmissionError names the Anthropic field)."""
        return chat_request_from(self._chat_fields())

    def _chat_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"model": self.model, "messages": self._chat_messages()}
        if self.tools:
            fields["tools"] = [_function(tool) for tool in self.tools]
        if self.tool_choice is not None:
            if self.tool_choice.type in ("any", "tool") and not self.tools:
                raise AdmissionError(
                    f"tool_choice {self.tool_choice.type} needs at least one tool", field="tool_choice"
                )
            fields.update(_tool_choice(self.tool_choice))
        if self.thinking is not None:
            fields.update(self._thinking_fields(self.thinking))
        return fields

    def _thinking_fields(self, thinking: ThinkingConfig) -> dict[str, Any]:
        if thinking.type != "enabled":
            if thinking.budget_tokens is not None:
                raise AdmissionError("thinking.budget_tokens is for type enabled", field="thinking.budget_tokens")
            return {"chat_template_kwargs": {"enable_thinking": thinking.type == "adaptive"}}
        if thinking.budget_tokens is None:
            raise AdmissionError("thinking.budget_tokens is required for type enabled", field="thinking.budget_tokens")
        return {"chat_template_kwargs": {"enable_thinking": True}, "max_reasoning_tokens": thinking.budget_tokens}

    def _chat_messages(self) -> list[dict[str, Any]]:
        system = self.system if isinstance(self.system, str) or self.system is None else _text(self.system)
        chat: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
        for index, message in enumerate(self.messages):
            blocks = message.blocks(index)
            chat += _user_messages(blocks) if message.role == "user" else [_assistant_message(blocks)]
        return chat


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. Bounds are Anthropic's (temperature in [0, 1])."""

    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    metadata: Metadata | None = None

    def chat_request(self) -> ChatCompletionRequest:
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= self.max_tokens:
            raise AdmissionError(
                f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens ({self.max_tokens})",
                field="thinking.budget_tokens",
            )
        fields = self._chat_fields()
        fields.update(
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
            stream=self.stream,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        return chat_request_from(fields)


def _block(part: dict[str, Any], field: str, allowed: set[str]) -> Block:
    kind = part.get("type")
    if kind not in allowed:
        role = "assistant" if "tool_use" in allowed else "user"
        raise AdmissionError(
            f"{field}: content blocks of type {kind!r} are not supported in {role} messages", field=field
        )
    try:
        return _BLOCKS[kind].model_validate(part)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join([field, *(str(p) for p in first.get("loc", ()))])
        raise AdmissionError(f"{where}: {first.get('msg', 'invalid value')}", field=where) from None


def _text(blocks: list[TextBlock]) -> str:
    return "".join(block.text for block in blocks)


def _user_messages(blocks: list[Block]) -> list[dict[str, Any]]:
    """Runs of text become user messages, each tool result a tool message, in their order."""
    chat: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            content = block.text()
            if block.is_error:  # the OpenAI tool message has no error flag: the text says it
                content = f"error: {content}"
            chat.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, TextBlock):
            if chat and chat[-1]["role"] == "user":
                chat[-1]["content"] += block.text
            else:
                chat.append({"role": "user", "content": block.text})
    return chat


def _assistant_message(blocks: list[Block]) -> dict[str, Any]:
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _function(tool: AnthropicTool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: AnthropicToolChoice) -> dict[str, Any]:
    if (choice.type == "tool") != (choice.name is not None):
        raise AdmissionError("tool_choice.name is given with type tool, and only then", field="tool_choice.name")
    if choice.type == "none" and choice.disable_parallel_tool_use is not None:
        raise AdmissionError("tool_choice.disable_parallel_tool_use is not for type none", field="tool_choice")
    mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if choice.type == "tool":
        mapped = {"type": "function", "function": {"name": choice.name}}
    fields: dict[str, Any] = {"tool_choice": mapped}
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields
