"""The one path from a chat request into the engine, shared by OpenAI's /v1/chat/completions,
Anthropic's /v1/messages and OpenAI's /v1/responses: the chat prompt, the reasoning budget, each
choice's sampling parameters and the shape its reply is built with. The two other APIs translate
their bodies into a ChatCompletionRequest and come here; nothing of sampling, guided decoding or
the parsers is decided twice."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, TypeAlias

from ifb.runtime.engine_client import EngineClient
from ifb.runtime.errors import AdmissionError
from ifb.runtime.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser
from ifb.runtime.reasoning_budget import ReasoningBudget
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from ifb.runtime.server.responses import Choice, ResponseShape
from ifb.runtime.server.streams import Stream, refuse_queue_timeouts
from ifb.runtime.server.tool_parsers import ToolCallParser
from ifb.runtime.server.tools import ToolPlan

OpenAIRequest: TypeAlias = CompletionRequest | ChatCompletionRequest


@dataclass(frozen=True, slots=True)
class ChatServing:
    """What the server decides for every chat request: its engine and its parsers."""

    engine: EngineClient
    reasoning: ReasoningParser
    tool_parser: ToolCallParser


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """One chat request made ready for the engine: its prompt, tools, reasoning budget and
    whether its reply keeps special tokens (for the tool-call parser)."""

    serving: ChatServing
    body: ChatCompletionRequest
    prompt_token_ids: list[int]
    prompt_tail: str  # the prompt's end as text, for a reasoning parser that reads it
    tools: ToolPlan
    budget: ReasoningBudget | None
    shows_special: bool

    def params(self, index: int = 0) -> SamplingParams:
        return choice_params(self.body, index, self.budget, self.shows_special)

    def shape(self, response_id: str, model: str) -> ResponseShape:
        serving = self.serving
        return ResponseShape(
            response_id, int(time.time()), model, True, serving.engine.token_text, self.tools,
            serving.reasoning, self.prompt_tail, serving.tool_parser,
        )  # fmt: skip

    async def open_one(self) -> tuple[Choice, Stream]:
        """The request's single choice, seated in the engine (a queue timeout raises a 429 on
        the stream's first delta)."""
        choice = Choice(0, 0, self.prompt_token_ids, self.params(0))
        (opened,) = await self.serving.engine.open_streams([(choice.prompt_token_ids, choice.params)])
        return choice, refuse_queue_timeouts(opened)


async def prepare_chat(serving: ChatServing, body: ChatCompletionRequest) -> PreparedChat:
    """Tokenize the chat prompt off the loop and decide what the body leaves to the server."""
    tools = body.tool_plan()
    prompt, tail = await chat_prompt(serving, body)
    budget = reasoning_budget(body, serving.reasoning, tail)
    shows = shows_special_tokens(serving.tool_parser, body, tools)
    return PreparedChat(serving, body, prompt, tail, tools, budget, shows)


async def chat_prompt(serving: ChatServing, body: ChatCompletionRequest) -> tuple[list[int], str]:
    """The chat prompt's token ids, and its end as text when the reasoning parser reads it."""
    engine = serving.engine
    tools = body.tool_plan().template_tools()
    return await engine.off_loop(
        _chat_prompt, engine, body.chat_messages(), tools, body.chat_template_kwargs, serving.reasoning
    )


def choice_params(
    body: OpenAIRequest, index: int, budget: ReasoningBudget | None, shows_special: bool
) -> SamplingParams:
    """Choice `index`'s parameters: the body's, with what the server decides for it."""
    params = body.sampling_params(index)
    skip = params.skip_special_tokens and not shows_special
    return replace(params, reasoning_budget=budget, skip_special_tokens=skip)


def shows_special_tokens(parser: ToolCallParser, body: OpenAIRequest, tools: ToolPlan) -> bool:
    """A reply the tool-call parser reads for `auto` calls keeps its family's special-token
    markers ([TOOL_CALLS], <|python_tag|>), unless the client said skip_special_tokens itself."""
    return tools.mode == "auto" and parser.markers.special_tokens and "skip_special_tokens" not in body.model_fields_set


def reasoning_budget(body: ChatCompletionRequest, reasoning: ReasoningParser, tail: str) -> ReasoningBudget | None:
    """The request's reasoning budget, where its reply starts as the reasoning parser reads it."""
    tokens = body.reasoning_budget_tokens()
    if tokens is None:
        return None
    inside = reasoning.starts_inside(tail, guided=body.guided() is not None)
    if inside is None:
        field = "max_reasoning_tokens" if body.max_reasoning_tokens is not None else "thinking_budget"
        raise AdmissionError(f"{field} needs a reasoning parser (--reasoning-parser qwen3|deepseek_r1)", field=field)
    return ReasoningBudget(tokens, inside)


def _chat_prompt(
    engine: EngineClient,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
    reasoning: ReasoningParser,
) -> tuple[list[int], str]:
    ids = engine.apply_chat_template(messages, tools, chat_template_kwargs)
    tail = engine.detokenize(ids[-PROMPT_TAIL_TOKENS:]) if reasoning.reads_prompt else ""
    return ids, tail
