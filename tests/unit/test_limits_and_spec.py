"""Build-time validation: limits against the model, unsupported architectures."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig

from ifb.builder.errors import LimitsError, UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.limits import resolve_limits

SPEC = model_spec_from_hf_config(
    LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
)


def limits(**overrides: object):
    kwargs = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=256, block_size=16, dtype="float32")
    kwargs.update(overrides)
    return resolve_limits(SPEC, **kwargs)  # type: ignore[arg-type]


def test_default_pool_holds_every_seat_at_full_length() -> None:
    assert limits().num_kv_blocks == 4 * 16


@pytest.mark.parametrize(
    "overrides,words",
    [
        (dict(max_seq_len=1024), ["max_seq_len 1024", "max_position_embeddings=512"]),
        (dict(max_num_tokens=2), ["max_num_tokens 2", "max_batch_size 4"]),
        (dict(kv_blocks=10), ["10 blocks", "max_seq_len 256 needs 16 blocks"]),
        (dict(block_size=12), ["block_size", "power of two"]),
        (dict(max_batch_size=0), ["max_batch_size must be >= 1"]),
        (dict(kv_blocks=20, kv_memory_gb=1.0), ["either kv_blocks or kv_memory"]),
    ],
)
def test_bad_limits_name_field_value_and_bound(overrides: dict, words: list[str]) -> None:
    with pytest.raises(LimitsError) as error:
        limits(**overrides)
    for word in words:
        assert word in str(error.value)


def test_kv_memory_sizes_the_pool() -> None:
    bytes_per_block = 2 * 2 * 16 * 4 * 16 * 4  # K+V, layers, block, kv heads, head_dim, fp32
    assert limits(kv_memory_gb=bytes_per_block * 100 / 1e9).num_kv_blocks == 100


def test_unsupported_architecture_names_itself_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedModelError) as error:
        model_spec_from_hf_config(GPT2Config())
    assert "GPT2LMHeadModel" in str(error.value) or "gpt2" in str(error.value)
    assert "llama" in str(error.value) and "qwen2" in str(error.value)
