"""A hand-made EngineConfig (no build) for tests of what reads engine.json."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ifb.runtime.engine_format import (
    BackendKind,
    BuildOptionsRecord,
    EngineConfig,
    EngineLimits,
    EngineSource,
    ModelSpec,
)

LIMITS = {"max_batch_size": 4, "max_num_tokens": 64, "max_seq_len": 128}
SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    attention_bias=False,
    bos_token_id=1,
    eos_token_ids=(2,),
)


def engine_config(**changes: Any) -> EngineConfig:
    """A float32 CPU engine of LIMITS; `changes` replace its fields."""
    config = EngineConfig(
        model_name="tiny",
        spec=SPEC,
        limits=EngineLimits(**LIMITS, block_size=16, num_kv_blocks=64),
        dtype="float32",
        kv_dtype="float32",
        backend=BackendKind.CPU,
        rope_scaling=1.0,
        step_package="step.pt2",
        weights="weights.safetensors",
        tokenizer_folder="tokenizer",
        has_chat_template=False,
        source=EngineSource(kind="hf_folder", path="tiny", sha256="0" * 64),
        build_id="build-1",
        builder_version="test",
        build_options=BuildOptionsRecord(**LIMITS, block_size=16, kv_blocks=64, dtype="float32", backend="cpu"),
    )
    return replace(config, **changes)
