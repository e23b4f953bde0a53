"""Guided decoding inside the running batch: outputs always match their constraint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_harness import running_server

from ifb import LLM, SamplingParams
from ifb.runtime.errors import AdmissionError
from ifb.runtime.guided import GuidedDecoding
from ifb.runtime.request import FinishReason

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "mood": {"type": "string", "enum": ["calm", "busy"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "mood", "n"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'


def guides() -> list[GuidedDecoding]:
    return [
        GuidedDecoding.json_schema(SCHEMA),
        GuidedDecoding.regex(REGEX),
        GuidedDecoding.choice(CHOICES),
        GuidedDecoding.grammar(GRAMMAR),
    ]


def check(guide: GuidedDecoding, text: str) -> None:
    if guide.kind.value == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif guide.kind.value == "regex":
        assert re.fullmatch(REGEX, text), text
    elif guide.kind.value == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([1-9](\+[1-9])*\)", text), text


@pytest.fixture(scope="module")
def llm(tiny_llama_engine: Path):
    with LLM(tiny_llama_engine) as instance:
        yield instance


def test_guided_outputs_match_across_many_seeds(llm: LLM) -> None:
    for guide in guides():
        params = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, guided=guide) for seed in range(12)]
        for output in llm.generate([[5, 6, 7]] * len(params), params):
            if guide.kind.value != "grammar":  # an unbounded grammar may be cut by length
                assert output.finish_reason is FinishReason.STOP, (guide.kind, output.text)
            if output.finish_reason is FinishReason.STOP:
                check(guide, output.text)


def test_guided_and_plain_requests_share_one_batch(llm: LLM) -> None:
    """Four guided + four plain requests are resident together; plain outputs equal alone."""
    plain = [([10 + i, 11], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)) for i in range(4)]
    alone = [llm.generate([p], s)[0].token_ids for p, s in plain]
    sizes: list[int] = []
    llm.executor.step_listeners.append(lambda step: sizes.append(step.num_requests))
    guided = [
        ([5, 6], SamplingParams(max_tokens=40, temperature=0.7, seed=i, guided=g)) for i, g in enumerate(guides())
    ]
    outputs = llm.generate([p for p, _ in guided + plain], [s for _, s in guided + plain])
    llm.executor.step_listeners.clear()
    assert max(sizes) == 8
    assert [o.token_ids for o in outputs[4:]] == alone
    for guide, output in zip(guides(), outputs[:4], strict=True):
        if output.finish_reason is FinishReason.STOP:
            check(guide, output.text)
    assert llm.stats().guided.num_requests >= 4


def test_guided_output_survives_preemption(tiny_llama_engine: Path) -> None:
    with LLM(tiny_llama_engine, policy="max_utilization", kv_blocks=16) as small:
        params = [
            SamplingParams(max_tokens=60, temperature=1.0, seed=s, guided=GuidedDecoding.json_schema(SCHEMA))
            for s in range(8)
        ]
        filler = [SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)] * 4
        outputs = small.generate([[5] * 30] * 8 + [[9] * 30] * 4, params + filler)
        assert small.stats().counters.preempted > 0
    for output in outputs[:8]:
        assert output.finish_reason is FinishReason.STOP
        jsonschema.validate(json.loads(output.text), SCHEMA)


@pytest.mark.parametrize(
    "guide,field",
    [
        (GuidedDecoding.json_schema('{"type": "object", "properties": 7}'), "guided_json"),
        (GuidedDecoding.regex("[a-z"), "guided_regex"),
        (GuidedDecoding.grammar("root ::= undefined_rule"), "guided_grammar"),
    ],
)
def test_invalid_constraints_are_refused_before_taking_a_seat(llm: LLM, guide: GuidedDecoding, field: str) -> None:
    before = llm.stats().counters.submitted
    with pytest.raises(AdmissionError) as error:
        llm.generate([[5]], SamplingParams(max_tokens=5, guided=guide))
    assert error.value.field == field and "invalid" in str(error.value)
    assert llm.stats().counters.submitted == before


def test_http_response_format_and_guided_fields(tiny_llama_engine: Path) -> None:
    with LLM(tiny_llama_engine) as instance, running_server(instance) as base:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 60,
            "temperature": 0.8,
            "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        }
        reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()
        jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), SCHEMA)
        choice = httpx.post(
            base + "/v1/completions", json={"prompt": "x", "max_tokens": 30, "guided_choice": CHOICES}, timeout=60
        ).json()
        assert choice["choices"][0]["text"] in CHOICES
        bad = httpx.post(base + "/v1/completions", json={"prompt": "x", "guided_regex": "(unclosed"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_regex"
        both = httpx.post(
            base + "/v1/completions", json={"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, timeout=60
        )
        assert both.status_code == 400
        guided = httpx.get(base + "/health").json()["guided"]
        assert guided["guided_requests"] >= 2 and guided["grammar_compile_seconds_total"] > 0
        assert "ifb:guided_requests_total" in httpx.get(base + "/metrics").text


def test_a_finished_constraint_outranks_min_tokens(llm: LLM) -> None:
    """The choice is complete after 'yes' but min_tokens bans EOS: the grammar wins and the request
    stops cleanly (found by the schema fuzzer as a 500: every token was masked)."""
    params = SamplingParams(max_tokens=10, min_tokens=5, temperature=0, guided=GuidedDecoding.choice(["yes"]))
    (out,) = llm.generate([[5, 6]], params)
    assert out.finish_reason is FinishReason.STOP and out.text == "yes" and out.error is None


def test_a_compile_past_its_timeout_is_cancelled(llm: LLM) -> None:
    """The timed-out compile's worker process is killed (the compile stops) and later compiles
    run on fresh workers."""
    compiler = llm.frontend.grammar_compiler()
    compiler.compile(GuidedDecoding.choice(["warm"]))  # workers up
    workers = list(compiler._pool._processes.values())  # type: ignore[attr-defined]
    with pytest.raises(AdmissionError, match="did not compile within"):
        compiler.compile(GuidedDecoding.regex("[a-z]{1,40}@[a-z]{1,30}"), timeout_s=0.0)
    for worker in workers:
        worker.join(5)
        assert not worker.is_alive()
    compiled, _ = compiler.compile(GuidedDecoding.choice(["again"]))
    assert compiled is not None


def test_characters_past_the_bmp_are_generated_as_utf8(llm: LLM) -> None:
    """A choice spelled in ASCII JSON turned U+10000 into a surrogate pair that xgrammar matched as
    CESU-8 bytes (ED A0 80 ...), which the surrogate guard refuses: every request ended in error
    (found by the fuzz test's guided_choice ['𐀀'])."""
    for guide, text in (
        (GuidedDecoding.choice(["\U00010000"]), "\U00010000"),
        (GuidedDecoding.choice(["a\U0001f600b"]), "a\U0001f600b"),
        (GuidedDecoding.json_schema(json.dumps({"enum": ["\U00010000"]})), '"\U00010000"'),
        (GuidedDecoding.regex("\U0001f600+"), "\U0001f600"),
    ):
        out = llm.generate([[5, 6]], SamplingParams(max_tokens=12, seed=0, guided=guide))[0]
        assert out.finish_reason is not FinishReason.ERROR, (guide, out.text)
        assert out.text.startswith(text), (guide, out.text)
