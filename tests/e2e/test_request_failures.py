"""One request's failure is that request's alone (issue 41): its text (detokenization), its stop
strings, its tool-call or reasoning parser, its logits processing (a guided mask) may raise; it
then ends with `error` (HTTP 500, or an SSE error event), a neighbour sharing its steps finishes
every token, and the next request is served. First the byte-fallback sequence that made
tokenizers' DecodeStream raise and took the whole step loop down: now its text is recovered.

Each test holds the neighbour's first step (StepGate) until the request that fails has been
submitted, so the two share steps whatever the machine's speed; `batch_sizes` shows they did.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from byte_fallback import byte_fallback_tokenizer, byte_token, piece
from server_harness import running_server
from waiting import StepGate, wait_until

from ifb import LLM, SamplingParams
from ifb.runtime import detokenizer as detokenizer_module
from ifb.runtime import guided as guided_module
from ifb.runtime import reasoning as reasoning_module
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.engine_format.artifacts import artifact_hashes
from ifb.runtime.outputs import RequestOutput
from ifb.runtime.request import FinishReason
from ifb.runtime.server import tool_parsers

NEIGHBOUR_TOKENS = 24
FORCED = 100  # a token the failing request is forced to sample (logit_bias) and its neighbours never do
NEIGHBOUR = SamplingParams(max_tokens=NEIGHBOUR_TOKENS, temperature=0, ignore_eos=True, logit_bias={FORCED: -100})
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
Post = Callable[[dict[str, Any]], tuple[int, str]]


@pytest.fixture(scope="module")
def llm(tiny_llama_engine: Path) -> Iterator[LLM]:
    with LLM(tiny_llama_engine, max_batch_size=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def base(llm: LLM) -> Iterator[str]:
    with running_server(llm, reasoning_parser="deepseek_r1", tool_call_parser="hermes") as base:
        yield base


@pytest.fixture(scope="module")
def byte_fallback_engine(tiny_llama_engine: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a SentencePiece-style byte-fallback tokenizer of the same 320 ids in
    its tokenizer folder, the engine record resealed over the new files as the builder seals it."""
    engine = tmp_path_factory.mktemp("byte-fallback") / "engine"
    shutil.copytree(tiny_llama_engine, engine)
    config = EngineConfig.load(engine)
    shutil.rmtree(config.tokenizer_path)
    byte_fallback_tokenizer().save_pretrained(config.tokenizer_path)
    replace(config, artifacts=artifact_hashes(engine)).write(engine)
    return engine


def neighbour(llm: LLM) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    llm.submit([5, 6, 7], NEIGHBOUR, outputs.append)
    return outputs


def assert_finished_every_token(outputs: list[RequestOutput]) -> None:
    wait_until(lambda: bool(outputs) and outputs[-1].finished, 120, "the neighbour to finish")
    assert outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1]
    assert outputs[-1].num_output_tokens == NEIGHBOUR_TOKENS


def together(llm: LLM, body: Callable[[], None]) -> None:
    """Run `body` (which sends the request that fails) beside a neighbour whose first step waits
    for it; the neighbour then finishes every token and a later request is served."""
    with StepGate(llm.executor) as gate:
        gate.allow = lambda batch: len(gate.submitted) >= 2  # the neighbour and the failing request
        outputs = neighbour(llm)
        body()
        assert_finished_every_token(outputs)
    assert 2 in gate.batch_sizes, gate.batch_sizes  # they shared a step
    assert llm.health().ok
    later = llm.generate([5, 6, 7], NEIGHBOUR)[0]
    assert later.finish_reason is FinishReason.LENGTH and len(later.token_ids) == NEIGHBOUR_TOKENS


def post(base: str, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """(status, body text); a stream is read whole (its events are lines)."""
    response = httpx.post(base + path, json=body, timeout=120)
    return response.status_code, response.text


def sse_error(text: str) -> str:
    """The message of the stream's error event; it must end with [DONE]."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e and "choices" not in e]
    assert len(errors) == 1, events
    assert errors[0]["type"] == "server_error"
    return str(errors[0]["message"])


# -- detokenization: the byte-fallback sequence of the Gemma 2 report -------------------------------
BYTE_FALLBACK_BODY = {
    # The prompt ends with the byte token "x" (the stream's context); the output is forced to a lone
    # lead byte (0xE2: only it, min_tokens bans the stop token) then "j": the sequence that made
    # DecodeStream raise "Invalid prefix ... Expected prefix: 'x', Actual string: '\ufffd\ufffdj'".
    "prompt": [piece("▁hello"), byte_token(0x78)],
    "max_tokens": 4,
    "temperature": 0,
    "min_tokens": 1,
    "stop_token_ids": [piece("j")],
    "logit_bias": {str(byte_token(0xE2)): 50, str(piece("j")): 100},
}


def test_byte_fallback_output_that_broke_decode_stream_is_served(byte_fallback_engine: Path) -> None:
    """Through LLM.generate (the report's path) and the server, streamed and not: the request
    gets its text ("\ufffdj", the bytes E2 6A decoded), its neighbour finishes, the engine takes
    the next request. Before the fix the step loop died and every later call got
    EngineUnavailableError."""
    with LLM(byte_fallback_engine, max_batch_size=4) as llm, running_server(llm) as base:
        params = SamplingParams(
            max_tokens=4,
            temperature=0,
            min_tokens=1,
            stop_token_ids=[piece("j")],
            logit_bias={byte_token(0xE2): 50, piece("j"): 100},
        )
        answers: list[Any] = []
        together(llm, lambda: answers.append(llm.generate(BYTE_FALLBACK_BODY["prompt"], params)[0]))
        assert answers[0].token_ids == (byte_token(0xE2), piece("j"))
        assert answers[0].text == "\ufffdj" and answers[0].finish_reason is FinishReason.STOP
        for stream in (False, True):
            replies: list[tuple[int, str]] = []
            body = {**BYTE_FALLBACK_BODY, "stream": stream}
            together(llm, lambda body=body, replies=replies: replies.append(post(base, "/v1/completions", body)))
            status, text = replies[0]
            assert status == 200, text
            if stream:
                events = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
                assert "".join(json.loads(e)["choices"][0]["text"] for e in events) == "\ufffdj"
            else:
                assert json.loads(text)["choices"][0]["text"] == "\ufffdj"


# -- detokenization and stop strings that raise (injected) --------------------------------------
def raise_on_forced_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: the stream decoder raises on FORCED, as a tokenizer whose decode fails on a
    sequence would (the real DecodeStream failure is recovered now, so none is left to drive)."""
    step = detokenizer_module._RustStreamDecoder.step

    def failing(self: Any, token_ids: list[int]) -> str:
        if FORCED in token_ids:
            raise RuntimeError(f"injected: token {FORCED} cannot be decoded")
        return step(self, token_ids)

    monkeypatch.setattr(detokenizer_module._RustStreamDecoder, "step", failing)


def raise_in_the_stop_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: the stop-string check of a request stopping at "zq" raises (push decodes and
    searches the stop strings in one call, so the patch wraps push for that request only)."""
    push = detokenizer_module.IncrementalDetokenizer.push

    def failing(self: Any, token_ids: list[int]) -> None:
        if "zq" in self.stop:
            raise RuntimeError("injected: the stop-string check failed")
        push(self, token_ids)

    monkeypatch.setattr(detokenizer_module.IncrementalDetokenizer, "push", failing)


@pytest.mark.parametrize(
    ("inject", "body"),
    [
        (raise_on_forced_token, {"logit_bias": {str(FORCED): 100}}),
        (raise_in_the_stop_check, {"stop": ["zq"]}),
    ],
    ids=["detokenization", "stop_string_check"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_failing_text_step_ends_only_its_request(
    llm: LLM,
    base: str,
    monkeypatch: pytest.MonkeyPatch,
    inject: Callable[[pytest.MonkeyPatch], None],
    body: dict[str, Any],
    stream: bool,
) -> None:
    """The request whose text fails ends with `error`: a 500 naming the fault, or an SSE error
    event and [DONE]; its neighbour (which never samples FORCED) finishes every token."""
    inject(monkeypatch)
    replies: list[tuple[int, str]] = []
    request = {"prompt": [9, 9], "max_tokens": 5, "temperature": 0, "stream": stream, **body}
    together(llm, lambda: replies.append(post(base, "/v1/completions", request)))
    status, text = replies[0]
    if stream:
        assert status == 200 and "injected" in sse_error(text)
    else:
        assert status == 500 and "injected" in json.loads(text)["error"]["message"]
        assert json.loads(text)["error"]["code"] == "request_failed"


# -- parsers of the reply: tool calls and reasoning (injected) ------------------------------------
def test_a_tool_call_parser_that_raises_fails_only_its_response(
    llm: LLM, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected: the hermes parser raises on the reply (the parsers catch malformed JSON
    themselves, so no reply of the tiny model makes them raise). A 500, or an SSE error event
    and [DONE] instead of a cut connection; the neighbour and the next request are served."""

    def failing(self: Any, text: str, names: Any) -> Any:
        raise RuntimeError("injected: the tool-call parser failed")

    monkeypatch.setattr(tool_parsers.HermesToolParser, "parse", failing)
    for stream in (False, True):
        replies: list[tuple[int, str]] = []
        request = {
            "messages": [{"role": "user", "content": "call lookup"}],
            "tools": TOOLS,
            "max_tokens": 4,
            "temperature": 0,
            "stream": stream,
        }
        together(
            llm, lambda request=request, replies=replies: replies.append(post(base, "/v1/chat/completions", request))
        )
        status, text = replies[0]
        if stream:
            assert status == 200 and "injected: the tool-call parser failed" in sse_error(text)
        else:
            assert status == 500, text
            assert "RuntimeError: injected: the tool-call parser failed" in json.loads(text)["error"]["message"]
    plain = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    assert post(base, "/v1/chat/completions", plain)[0] == 200  # no tools: no parser, served


def test_a_reasoning_parser_that_raises_fails_only_its_response(
    llm: LLM, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected: the reasoning split (deepseek_r1) raises inside a think block (it has no
    input it refuses). A 500, or an SSE error event and [DONE]; completions, which no
    reasoning parser reads, are served beside it and after it."""
    feed = reasoning_module.ReasoningStream.feed

    def failing(self: Any, text: str) -> Any:
        if self.inside:
            raise ValueError("injected: the reasoning parser failed")
        return feed(self, text)

    monkeypatch.setattr(reasoning_module.ReasoningStream, "feed", failing)
    for stream in (False, True):
        replies: list[tuple[int, str]] = []
        request = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 4, "stream": stream}
        together(
            llm, lambda request=request, replies=replies: replies.append(post(base, "/v1/chat/completions", request))
        )
        status, text = replies[0]
        if stream:
            assert status == 200 and "injected: the reasoning parser failed" in sse_error(text)
        else:
            assert status == 500 and "injected: the reasoning parser failed" in text
    assert post(base, "/v1/completions", {"prompt": [5], "max_tokens": 3})[0] == 200


# -- logits processing: a guided request's mask (injected) ----------------------------------------
def test_a_guided_mask_that_raises_fails_only_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: filling the grammar's token mask raises (xgrammar's matcher, wrapped). The
    guided request ends with `error` naming it; the unguided neighbour in the same steps
    finishes every token (before, the whole step failed); unpatched, a guided request is served."""
    fill = guided_module.GuidedMatcher.fill_next_token_bitmask

    def failing(self: Any, bitmask: Any, index: int = 0) -> None:
        raise RuntimeError("injected: the grammar's mask failed")

    guided = SamplingParams(max_tokens=8, temperature=0, guided=guided_module.GuidedDecoding.choice(["yes", "no"]))
    monkeypatch.setattr(guided_module.GuidedMatcher, "fill_next_token_bitmask", failing)
    answers: list[Any] = []
    together(llm, lambda: answers.append(llm.generate([9, 9], guided)[0]))
    assert answers[0].finish_reason is FinishReason.ERROR
    assert "injected: the grammar's mask failed" in (answers[0].error or "")
    monkeypatch.setattr(guided_module.GuidedMatcher, "fill_next_token_bitmask", fill)
    served = llm.generate([9, 9], guided)[0]
    assert served.finish_reason is FinishReason.STOP and served.text in ("yes", "no")


def test_a_request_whose_setup_raises_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Injected: making a guided request's grammar matcher raises on the executor thread (where
    a request's sampling state and detokenizer are made). That request ends with `error`; the
    neighbour finishes every token. Before, the exception left the inbox and the loop died."""

    def failing(self: Any) -> Any:
        raise RuntimeError("injected: the matcher cannot be made")

    guided = SamplingParams(max_tokens=8, temperature=0, guided=guided_module.GuidedDecoding.choice(["yes", "no"]))
    monkeypatch.setattr(guided_module.CompiledGuide, "matcher", failing)
    answers: list[Any] = []
    with StepGate(llm.executor) as gate:
        gate.allow = lambda batch: len(gate.submitted) >= 2  # the neighbour waits for the failing request
        outputs = neighbour(llm)
        answers.append(llm.generate([9, 9], guided)[0])
        assert_finished_every_token(outputs)
    assert answers[0].finish_reason is FinishReason.ERROR
    assert "injected: the matcher cannot be made" in (answers[0].error or "")
    assert llm.health().ok
    assert llm.generate([5, 6, 7], NEIGHBOUR)[0].finish_reason is FinishReason.LENGTH
