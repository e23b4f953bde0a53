"""The soak's request kinds: what each one sends, and what its reply must look like.

`send(client, base, kind, rng, replies)` sends one request of `kind` and returns an `Outcome`:
the first choice's finish reason (or "aborted" for a stream dropped on purpose) and, when the
reply is wrong, a `problem` naming what (an HTTP status, a transport error, a cut stream, an SSE
error event, a reply of the wrong shape, or a repeated greedy/seeded request whose text changed).
Every problem fails the soak; the only outcome besides a finish reason that is expected is
"aborted", for the `abort` kind.

Kinds that need the server's options (bench/soak.py starts it with them):
- `reasoning`: a chat with `enable_thinking`, so THINKING_TEMPLATE opens `<think>` in the prompt
  and `--reasoning-parser qwen3` returns the reply as `reasoning_content` up to a `</think>`;
  often with a reasoning budget (`max_reasoning_tokens`), which forces the close after its tokens.
- `reasoning_guided`: thinking off, a guided regex that spells a think block out
  (`<think>abc</think>xyz`: the reply, not the prompt, opens it), sometimes with a budget.
- `spec_greedy` / `spec_seeded`: repetitive prompts (prompt lookup finds drafts in them), some with
  a `cache_salt` (the suffix cache's tenants), from a fixed pool, so each is sent many times
  amid different batches: the README promises output token for token as without speculation
  whatever shares the step, so every repeat must give the first one's text.
  Greedy `reasoning` requests from a pool are checked the same way.
"""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 8}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
KINDS = [
    "plain",
    "stream",
    "chat",
    "n3",
    "json",
    "choice",
    "tools_auto",
    "tools_required",
    "seeded",
    "abort",
    "reasoning",
    "reasoning_guided",
    "spec_greedy",
    "spec_seeded",
]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "weather", "in", "Paris", "time"]
# SmolLM2's own ChatML template, with Qwen3's switch: `enable_thinking` opens a think block in the prompt.
THINKING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
SPELLED = re.compile(r"<think>[a-z]{1,8}</think>[a-z ]{1,16}")
REPEATED = [
    "one two three four five six seven eight nine ten " * 4,
    "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Paris is in France. Rome is in Italy. Madrid is in Spain. Paris is in France. Rome is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,",
]
SALTS = [None, "tenant-a", "tenant-b"]
ALLOWED_FINISH = {"stop", "length"}
TOOL_FINISH = {"stop", "length", "tool_calls"}


@dataclass(frozen=True, slots=True)
class Outcome:
    finish: str  # the first choice's finish reason, "aborted", or what went wrong ("http_500")
    problem: str | None = None  # None: the reply is what its kind must give
    detail: str = ""  # for a problem: the request and the reply's start, to reproduce it
    reasoned: bool = False  # the reply had reasoning_content


@dataclass(slots=True)
class Reply:
    """One choice as the client saw it, streamed or not."""

    finish: str | None = None
    text: str | None = None  # a completion's text or a chat message's content
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    num_choices: int = 0
    completion_tokens: int | None = None
    reasoning_after_content: bool = False  # streamed: a reasoning delta came after content


class Repeats:
    """First replies of pooled greedy/seeded requests, by request key: a repeat must match."""

    def __init__(self) -> None:
        self._first: dict[str, tuple[str | None, str, str]] = {}
        self._lock = threading.Lock()
        self.num_checked = 0

    def check(self, key: str, reply: Reply) -> str | None:
        seen = (reply.finish, reply.reasoning or "", reply.text or "")  # streams send no empty parts
        with self._lock:
            first = self._first.setdefault(key, seen)
            self.num_checked += first is not seen
        return None if first == seen else f"repeat_differs: first {first!r}, now {seen!r}"


def request_body(kind: str, rng: random.Random) -> tuple[str, dict[str, Any], str | None]:
    """(path, body, repeat key) of one request of `kind`; the key is set for pooled requests."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body: dict[str, Any] = {"max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7, 1.0])}
    chat = kind in ("chat", "tools_auto", "tools_required") or kind.startswith("reasoning")
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    key = None
    if kind.startswith("tools"):
        body |= {"tools": TOOLS, "tool_choice": kind.removeprefix("tools_"), "max_tokens": 64}
        body["stream"] = rng.random() < 0.5
    elif kind == "n3":
        body["n"] = 3
    elif kind == "json":
        body["guided_json"] = SCHEMA
    elif kind == "choice":
        body["guided_choice"] = ["yes", "no", "maybe"]
    elif kind == "seeded":
        body["seed"] = rng.randint(0, 1000)
    elif kind in ("stream", "abort"):
        body["stream"] = True
    elif kind == "reasoning":
        body, key = _reasoning_body(body, rng)
    elif kind == "reasoning_guided":
        body |= {"guided_regex": SPELLED.pattern, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": False}}
        if rng.random() < 0.5:
            body["max_reasoning_tokens"] = rng.choice([0, 2, 4])
    elif kind.startswith("spec"):
        body, key = _spec_body(kind, body, rng)
    if body.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return path, body, key


def _reasoning_body(body: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str | None]:
    body["chat_template_kwargs"] = {"enable_thinking": True}
    body["stream"] = rng.random() < 0.5
    if rng.random() < 0.5:  # pooled and greedy: repeats must match
        index, budget = rng.randrange(2), rng.choice([None, 3, 8])
        body |= {"messages": [{"role": "user", "content": REPEATED[index]}], "temperature": 0, "max_tokens": 40}
        key = f"reasoning/{index}/{budget}"
    else:
        budget, key = rng.choice([None, 0, 2, 8, 16]), None
    if budget is not None:
        body["max_reasoning_tokens"] = budget
    return body, key


def _spec_body(kind: str, body: dict[str, Any], rng: random.Random) -> tuple[dict[str, Any], str]:
    index, salt = rng.randrange(len(REPEATED)), rng.choice(SALTS)
    body |= {"prompt": REPEATED[index], "max_tokens": (32, 64)[index % 2], "stream": rng.random() < 0.5}
    if salt is not None:
        body["cache_salt"] = salt  # decides only which drafts are found, never the output
    if kind == "spec_greedy":
        body["temperature"] = 0
        return body, f"greedy/{index}"
    body |= {"temperature": 0.8, "seed": index}
    return body, f"seeded/{index}"


def send(client: httpx.Client, base: str, kind: str, rng: random.Random, repeats: Repeats) -> Outcome:
    path, body, key = request_body(kind, rng)
    try:
        reply, problem = _exchange(client, base + path, body, aborting=kind == "abort")
    except httpx.HTTPError as error:
        return Outcome(f"transport_{type(error).__name__}", "transport error", _detail(body, repr(error)))
    if reply is None:
        return Outcome("aborted")
    if problem is None:
        problem = check(kind, body, reply)
    if problem is None and key is not None:
        problem = repeats.check(key, reply)
    if problem is not None:
        return Outcome(reply.finish or "none", problem, _detail(body, repr(reply)), bool(reply.reasoning))
    return Outcome(reply.finish or "none", reasoned=bool(reply.reasoning))


def _detail(body: dict[str, Any], reply: str) -> str:
    return f"request {json.dumps(body)[:1500]} -> {reply[:1500]}"


def _exchange(client: httpx.Client, url: str, body: dict[str, Any], aborting: bool) -> tuple[Reply | None, str | None]:
    """The reply's first choice (None: a stream dropped on purpose), and a transport-level problem."""
    if not body.get("stream"):
        response = client.post(url, json=body)
        if response.status_code != 200:
            return Reply(
                finish=f"http_{response.status_code}", text=response.text[:500]
            ), f"http {response.status_code}"
        return _whole_reply(response.json()), None
    reply = Reply()
    calls: dict[int, dict[str, Any]] = {}
    with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            response.read()
            return Reply(
                finish=f"http_{response.status_code}", text=response.text[:500]
            ), f"http {response.status_code}"
        done = False
        for i, line in enumerate(response.iter_lines()):
            if aborting and i >= 3:
                return None, None  # leaving the block closes the connection: the server must abort
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return reply, f"sse error event: {event['error']}"
                _add_chunk(reply, event, calls)
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    if not done:
        return reply, "cut stream: no [DONE]"
    return reply, None


def _whole_reply(data: dict[str, Any]) -> Reply:
    first = data["choices"][0]
    reply = Reply(finish=first["finish_reason"], num_choices=len(data["choices"]))
    reply.completion_tokens = data.get("usage", {}).get("completion_tokens")
    if "message" in first:
        message = first["message"]
        reply.text, reply.reasoning = message.get("content"), message.get("reasoning_content")
        reply.tool_calls = [c["function"] for c in message.get("tool_calls") or []]
    else:
        reply.text = first["text"]
    return reply


def _add_chunk(reply: Reply, event: dict[str, Any], calls: dict[int, dict[str, Any]]) -> None:
    if event.get("usage"):
        reply.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event["choices"]:
        reply.num_choices = max(reply.num_choices, choice["index"] + 1)
        if choice["index"] != 0:
            continue
        reply.finish = choice.get("finish_reason") or reply.finish
        delta = choice.get("delta", {})
        if "text" in choice:
            reply.text = (reply.text or "") + choice["text"]
        if delta.get("reasoning_content"):
            reply.reasoning_after_content |= bool(reply.text)
            reply.reasoning = (reply.reasoning or "") + delta["reasoning_content"]
        if delta.get("content"):
            reply.text = (reply.text or "") + delta["content"]
        for call in delta.get("tool_calls") or []:
            slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
            function = call.get("function", {})
            slot["name"] += function.get("name") or ""
            slot["arguments"] += function.get("arguments") or ""


def check(kind: str, body: dict[str, Any], reply: Reply) -> str | None:
    """What is wrong with a complete reply of `kind` (None: nothing)."""
    allowed = TOOL_FINISH if kind.startswith("tools") else ALLOWED_FINISH
    if reply.finish not in allowed:
        return f"finish_reason {reply.finish!r} not in {sorted(allowed)}"
    if reply.num_choices != body.get("n", 1):
        return f"{reply.num_choices} choices for n={body.get('n', 1)}"
    if reply.completion_tokens is None or reply.completion_tokens > body["max_tokens"] * body.get("n", 1):
        return f"usage.completion_tokens {reply.completion_tokens} (max_tokens {body['max_tokens']})"
    if kind == "json" and reply.finish == "stop":
        return _check_json(reply.text or "")
    if kind == "choice" and reply.finish == "stop" and reply.text not in body["guided_choice"]:
        return f"guided_choice gave {reply.text!r}"
    if kind.startswith("tools"):
        return _check_tools(kind, reply)
    if kind.startswith("reasoning"):
        return _check_reasoning(kind, body, reply)
    return None


def _check_json(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return f"guided_json finished 'stop' with text that is not JSON: {text!r}"
    if not isinstance(value, dict):
        return f"guided_json gave a non-object: {text!r}"
    if ("a" in value and type(value["a"]) is not int) or ("b" in value and not _short(value["b"], 8)):
        return f"guided_json broke the schema: {text!r}"
    return None


def _short(value: Any, limit: int) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _check_tools(kind: str, reply: Reply) -> str | None:
    if kind == "tools_required" and reply.finish != "tool_calls":
        return f"tool_choice required finished {reply.finish!r} without a call"
    if (reply.finish == "tool_calls") != bool(reply.tool_calls):
        return f"finish_reason {reply.finish!r} with {len(reply.tool_calls)} tool calls"
    for call in reply.tool_calls:
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            return f"tool call arguments are not JSON: {call['arguments']!r}"
        name = call["name"]
        if name == "get_weather":
            valid = _short(arguments.get("city"), 12) and arguments.get("unit") in ("c", "f") and len(arguments) == 2
        elif name == "get_time":
            valid = _short(arguments.get("zone"), 8) and len(arguments) == 1
        else:
            return f"a call to an unknown tool {name!r}"
        if kind == "tools_required" and not valid:
            return f"a forced call broke its schema: {name} {call['arguments']!r}"
    return None


def _check_reasoning(kind: str, body: dict[str, Any], reply: Reply) -> str | None:
    if reply.reasoning_after_content:
        return f"a reasoning delta came after content: reasoning {reply.reasoning!r}, content {reply.text!r}"
    # Only the first </think> ends the block: content may hold tags the model writes after it.
    if "<think>" in (reply.reasoning or "") or "</think>" in (reply.reasoning or ""):
        return f"a think tag left in the reasoning: reasoning {reply.reasoning!r}, content {reply.text!r}"
    if kind == "reasoning_guided":
        if reply.finish != "stop" or SPELLED.fullmatch(f"<think>{reply.reasoning}</think>{reply.text}") is None:
            return f"the spelled block was not split: reasoning {reply.reasoning!r}, content {reply.text!r}"
        return None
    budget = body.get("max_reasoning_tokens")
    if budget == 0 and reply.reasoning:
        return f"budget 0 still reasoned: {reply.reasoning!r}"
    # A spent budget forces `</think>` (a few tokens); a reply that ran on well past it has content.
    ran_past = reply.finish == "length" and reply.completion_tokens is not None
    if budget is not None and ran_past and reply.completion_tokens >= budget + 12 and not reply.text:  # type: ignore[operator]
        return f"budget {budget} never closed the block in {reply.completion_tokens} tokens: {reply.reasoning!r}"
    return None
