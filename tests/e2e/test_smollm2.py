"""The bundled SmolLM2-135M-Instruct (GGUF) through the real builder: greedy equals transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_loop import greedy_generate

from ifb import LLM, SamplingParams
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.sources import load_model, resolve_source
from ifb.runtime.step.backend import StepMode
from ifb.runtime.step.engine import Engine
from ifb.runtime.step_budget.budgets import FixedBudget

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def smollm2_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("smollm2") / "engine"
    build_engine(
        None, output, BuildOptions(max_batch_size=4, max_num_tokens=128, max_seq_len=512, dtype="fp32", compute="fp32")
    )
    return output


@pytest.fixture(scope="module")
def hf_smollm2() -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM

    loaded = load_model(resolve_source(None))
    model = AutoModelForCausalLM.from_config(loaded.hf_config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict, strict=False)
    model.tie_weights()
    return model.eval(), loaded.tokenizer


def test_first_32_greedy_tokens_equal_transformers(smollm2_engine: Path, hf_smollm2: tuple) -> None:
    model, tokenizer = hf_smollm2
    engine = Engine.load(smollm2_engine, StepMode.COMPILED)
    for question in QUESTIONS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # explicit mask: the prompt contains <|im_end|>, which is also SmolLM2's pad token
            expected = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, eos_token_id=None
            )
            expected = expected[0, len(prompt) :].tolist()
        assert greedy_generate(engine, list(prompt), 32) == expected, question


def test_batched_chat_answers_are_coherent_and_equal_alone(smollm2_engine: Path) -> None:
    with LLM(smollm2_engine) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
        params = SamplingParams(max_tokens=24, temperature=0)
        together = llm.generate(prompts, params)
        alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert "Paris" in together[0].text


def test_guided_json_on_smollm2_validates_across_seeds(smollm2_engine: Path) -> None:
    import json

    import jsonschema

    from ifb.runtime.guided import GuidedDecoding

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    with LLM(smollm2_engine) as llm:
        prompt = llm.apply_chat_template([{"role": "user", "content": "Name a city and its country as JSON."}])
        params = [
            SamplingParams(max_tokens=48, temperature=0.8, seed=s, guided=GuidedDecoding.json_schema(schema))
            for s in range(4)
        ]
        choice = SamplingParams(max_tokens=8, temperature=0, guided=GuidedDecoding.choice(["Paris", "London", "Rome"]))
        outputs = llm.generate(
            [prompt] * 4 + [llm.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])], params + [choice]
        )
    for output in outputs[:4]:
        jsonschema.validate(json.loads(output.text), schema)
    assert outputs[4].text in ("Paris", "London", "Rome")  # the constraint, not the model's geography


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_gives_the_same_greedy_answers(smollm2_engine: Path, method: str) -> None:
    """The real model quoting and rewriting given text, where drafts from the prompt mostly hold:
    with speculation on, each answer is token for token the answer without it."""
    questions = [
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
        "Rewrite with a type hint: def add(a, b):\n    return a + b",
        QUESTIONS[0],
    ]
    params = SamplingParams(max_tokens=40, temperature=0)
    with LLM(smollm2_engine) as llm:
        prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
        off = llm.generate(prompts, params)
    with LLM(smollm2_engine, speculative=method) as llm:
        llm.executor.scheduler.step_budget = FixedBudget()  # every proposal verified: see test_speculative.py
        on = llm.generate(prompts, params) + [llm.generate([p], params)[0] for p in prompts]
        counters = llm.stats().counters
    assert [o.token_ids for o in on] == [o.token_ids for o in off] * 2
    assert counters.spec_num_accepted_tokens > 0
