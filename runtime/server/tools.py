"""Tool calling on /v1/chat/completions: `tools` + `tool_choice` in, `tool_calls` out.

- `none`: tools are shown to the chat template, the model answers in text.
- a named function: the reply is the function's arguments, constrained by the guided-decoding
  engine to its JSON schema, so they always parse and validate.
- `required`: the reply is {"name": ..., "arguments": ...} constrained to one of the tools
  (anyOf over the tools' schemas), so it always names a real tool with valid arguments.
- `auto`: the model decides; the calls in its text, in its family's format, are read by the
  server's tool-call parser (tool_parsers.py: hermes `<tool_call>` blocks, llama3_json, mistral).
  `parallel_tool_calls: false` returns the first of them only (as vLLM does; required and named
  make exactly one call anyway).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.server.tool_parsers import JSON_DECODER, CallHoldBack, CallMarkers, ToolCallParser
from ifb.runtime.unicode_text import require_unicode_strings


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request treats its tools."""

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...]
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: False returns at most one call

    @property
    def guided(self) -> GuidedDecoding | None:
        """The constraint that guarantees valid calls (required / named), else None."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.named)
            return GuidedDecoding.json_schema(tool.function.parameters, field="tool_choice")
        if self.mode == "required":
            return GuidedDecoding.json_schema({"anyOf": [_call_schema(t) for t in self.tools]}, field="tool_choice")
        return None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template expects them (None: the template sees no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools and self.mode != "none" else None

    def hold_back(self, parser: ToolCallParser) -> CallHoldBack:
        """What a stream of the reply holds back: nothing without tools, everything when a call
        is forced, and from where `parser` sees a call may open in `auto`."""
        if self.mode == "none":
            return CallHoldBack(CallMarkers())
        return CallHoldBack(parser.markers, opened=self.mode != "auto")

    def parse(self, text: str, parser: ToolCallParser) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished reply, `auto` calls read by `parser`; a forced call
        cut short (finish reason `length`) comes back as text, for the client to see, rather
        than as a broken call."""
        try:
            if self.mode == "named":  # normalized; the grammar made it
                return None, [_call(self.named or "", json.dumps(JSON_DECODER.decode(text)))]
            if self.mode == "required":
                call = JSON_DECODER.decode(text)
                return None, [_call(call["name"], json.dumps(call["arguments"]))]
            if self.mode == "auto":
                content, calls = parser.parse(text, {t.function.name for t in self.tools})
                return content, [_call(c.name, c.arguments) for c in calls[: None if self.parallel else 1]]
        except (ValueError, KeyError, TypeError, RecursionError):
            pass
        return text, []


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None = None) -> ToolPlan:
    """Check tools and tool_choice together; AdmissionError names the field. `parallel`:
    the request's parallel_tool_calls (None: OpenAI's default, true)."""
    tools = tools or []
    for index, tool in enumerate(tools):  # the chat template shows them; required / named compile them
        require_unicode_strings(tool.model_dump(exclude_none=True), "tools", f"tools.{index}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise AdmissionError("tools: function names must be unique", field="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise AdmissionError(
                f"tool_choice names function {choice.function.name!r}, which is not in tools", field="tool_choice"
            )
        return ToolPlan("named", tuple(tools), choice.function.name, parallel is not False)
    if choice in ("required", "auto") and not tools:
        raise AdmissionError(f"tool_choice {choice!r} needs at least one tool in tools", field="tool_choice")
    return ToolPlan(choice, tuple(tools), parallel=parallel is not False)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
