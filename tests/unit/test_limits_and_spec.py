"""Build-time validation: limits against the model, unsupported architectures."""

from __future__ import annotations

import pytest
from transformers import GPT2Config, LlamaConfig

from ifb.builder.errors import BuildError, LimitsError, UnsupportedModelError
from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.limits import check_kv_dtype_option, resolve_kv_dtype, resolve_limits
from ifb.runtime.engine_format import BackendKind, kv_bytes_per_block

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
    kwargs = dict(max_batch_size=4, max_num_tokens=64, max_seq_len=256, block_size=16, kv_dtype="float32")
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


def test_fp16_kv_memory_holds_twice_the_blocks() -> None:
    """--kv-memory sizes the pool in blocks of the KV dtype: the same gigabytes, 2x the blocks."""
    assert (
        kv_bytes_per_block(SPEC, 16, "float16") * 2
        == kv_bytes_per_block(SPEC, 16, "float32")
        == 2 * 2 * 16 * 4 * 16 * 4
    )
    gb = kv_bytes_per_block(SPEC, 16, "float32") * 100 / 1e9
    assert limits(kv_memory_gb=gb).num_kv_blocks == 100
    assert limits(kv_memory_gb=gb, kv_dtype="float16").num_kv_blocks == 200


@pytest.mark.parametrize(
    "kv_dtype,dtype,resolved",
    [
        ("auto", "float32", "float32"),
        ("auto", "bfloat16", "bfloat16"),
        ("fp16", "float32", "float16"),
        ("half", "float32", "float16"),
        ("bf16", "float32", "bfloat16"),
        ("float16", "bfloat16", "float16"),
        ("fp32", "float32", "float32"),
    ],
)
def test_kv_dtype_resolves_against_the_engine_dtype(kv_dtype: str, dtype: str, resolved: str) -> None:
    assert resolve_kv_dtype(kv_dtype, dtype) == resolved


def test_kv_dtype_wider_than_the_step_is_refused() -> None:
    with pytest.raises(LimitsError, match="--kv-dtype fp32 is wider than the engine's dtype bfloat16"):
        resolve_kv_dtype("fp32", "bfloat16")


def test_kv_dtype_other_than_auto_needs_the_cpu_backend() -> None:
    """One line naming the option and the backend; auto passes on every backend."""
    check_kv_dtype_option("auto", BackendKind.TENSORRT)
    check_kv_dtype_option("fp16", BackendKind.CPU)
    with pytest.raises(BuildError) as caught:
        check_kv_dtype_option("fp16", BackendKind.TENSORRT)
    assert "--kv-dtype fp16" in str(caught.value) and "--backend cpu" in str(caught.value)
    assert "tensorrt" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(BuildError, match="--kv-dtype 'int8' is not one of"):
        check_kv_dtype_option("int8", BackendKind.CPU)


def test_unsupported_architecture_names_itself_and_the_supported_list() -> None:
    with pytest.raises(UnsupportedModelError) as error:
        model_spec_from_hf_config(GPT2Config())
    assert "GPT2LMHeadModel" in str(error.value) or "gpt2" in str(error.value)
    assert "llama" in str(error.value) and "qwen2" in str(error.value)
