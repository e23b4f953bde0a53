"""Engine.step refuses inputs outside the engine's limits with a ValueError naming the limit.

Before the check, a block id past the KV pool aborted the process from inside the compiled step
(`terminate called after throwing an instance of 'c10::Error'`); it is exercised here in-process,
so a regression takes the test run down rather than passing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ifb.runtime.step.engine import Engine
from ifb.runtime.step.step_inputs import RequestSlice, StepInputs, build_step_inputs


@pytest.fixture(scope="module")
def engine(tiny_llama_engine: Path) -> Engine:
    return Engine.load(tiny_llama_engine)


def _decode(engine: Engine, block: int, context: int = 20) -> StepInputs:
    bs = engine.config.limits.block_size
    table = [block] * (-(-(context + 1) // bs))
    return build_step_inputs([RequestSlice([5], context, table, True)], bs)


def test_a_block_past_the_pool_is_refused_and_the_engine_still_steps(engine: Engine) -> None:
    blocks = engine.config.limits.num_kv_blocks
    with pytest.raises(ValueError, match="num_kv_blocks"):
        engine.step(_decode(engine, blocks))
    logits = engine.step(_decode(engine, blocks - 1))
    assert logits.shape == (1, engine.config.spec.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("input_ids", 10**6, "vocab_size"),
        ("input_ids", -1, "vocab_size"),
        ("positions", 10**6, "max_seq_len"),
        ("slot_mapping", 10**7, "num_kv_blocks \\* block_size"),
        ("logits_indices", 3, "token count"),
    ],
)
def test_each_bound_names_its_limit(engine: Engine, field: str, value: int, limit: str) -> None:
    inputs = _decode(engine, 0)
    bad = dataclasses.replace(inputs, **{field: torch.full_like(getattr(inputs, field), value)})
    with pytest.raises(ValueError, match=f"{field} holds {value}.*{limit}"):
        engine.step(bad)
