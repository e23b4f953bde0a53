"""builder/gguf_config.py: a GGUF's config read from the header alone equals transformers'
`AutoConfig.from_pretrained(gguf_file=...)` (which parses every element of the file's metadata), and the
header reader gives the families the values and tensors gguf's GGUFReader gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tiny_models import write_gguf, write_hf_checkpoint

from ifb.builder.gguf_config import gguf_config, transformers_config
from ifb.builder.gguf_fields import read_gguf_header
from ifb.builder.gguf_metadata import field_value

KQUANT_WIDTH = {"hidden_size": 256, "intermediate_size": 256}  # a K-quant block holds 256 weights
# (transformers model type, write_hf_checkpoint overrides): every family's GGUF as tests write it
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-blocks": ("llama", KQUANT_WIDTH),  # written with BLOCK_TYPES below
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "mistral-window": ("mistral", {"sliding_window": 16}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3_text", {"sliding_window": 8}),
}


# block formats of the "llama-blocks" file: a tensor's `data` is its rows of blocks, as GGUFReader gives them
BLOCK_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_1", "attn_v": "Q6_K", "ffn_down": "Q8_0", "ffn_up": "Q5_K"}


def reference_config(path: Path) -> Any:
    from transformers import AutoConfig

    from ifb.builder.families import register_llama_shaped_gguf_architectures

    register_llama_shaped_gguf_architectures()
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def every_key(key: str) -> bool:
    return True


def assert_same_config(path: Path) -> None:
    ours = transformers_config(read_gguf_header(path, every_key), path)
    reference = reference_config(path)
    assert type(ours) is type(reference)
    assert ours.to_dict() == reference.to_dict()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_config_equals_transformers(tmp_path: Path, name: str) -> None:
    """The config dict and class of every family's file equal AutoConfig's, and so does the whole config
    once the family has read its keys (ours over the header, the reference over gguf's GGUFReader)."""
    model_type, overrides = CHECKPOINTS[name]
    folder = write_hf_checkpoint(tmp_path / "hf", model_type, **overrides)
    types = BLOCK_TYPES if name == "llama-blocks" else None
    path = write_gguf(tmp_path / f"{name}.gguf", folder, tensor_types=types)
    assert_same_config(path)
    reader = gguf.GGUFReader(str(path))
    header = read_gguf_header(path, every_key)
    for key in reader.fields:
        if not key.startswith("GGUF."):
            assert field_value(header, key) == field_value(reader, key), key
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in header.tensors] == [
        (t.name, t.tensor_type, tuple(int(n) for n in t.shape)) for t in reader.tensors
    ]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.n_bytes == int(theirs.n_bytes)
        assert np.array_equal(ours.data, theirs.data), ours.name


def write_fields(path: Path, architecture: str, fields: dict[str, Any], tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF with these metadata values (a list is written as an array) and small F32 tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name in tensors:
        writer.add_tensor(name, np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_FIELDS: dict[str, Any] = {
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.block_count": 2,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": [f"t{i}" for i in range(40)],
    "tokenizer.ggml.bos_token_id": 1,
}


@pytest.mark.parametrize(
    "fields",
    [
        # Mistral by its name: transformers renames the architecture (keys and values) when it is exactly
        # "mistral"; no vocab_size key: the vocabulary's length; a one-element array is unwrapped
        {**LLAMA_FIELDS, "general.name": "mistral", "llama.attention.head_count_kv": [2]},
        {**LLAMA_FIELDS, "general.name": "Mistral-7B", "llama.attention.head_count_kv": 2},
        {**LLAMA_FIELDS, "llama.vocab_size": 40, "general.tags": ["a", "b"]},
    ],
)
@pytest.mark.parametrize("tensors", [(), ("output.weight",)])
def test_transformers_quirks_are_kept(tmp_path: Path, fields: dict[str, Any], tensors: tuple[str, ...]) -> None:
    """transformers' renames, one-element arrays, the vocabulary-size fallback and tied embeddings (no
    `output.weight`), as its reader does them."""
    assert_same_config(write_fields(tmp_path / "x.gguf", "llama", fields, tensors))


def test_config_of_a_large_vocabulary_reads_no_token(tmp_path: Path) -> None:
    """The config of a 262k-token file comes from its header without its strings: the vocabulary size is
    the array's length."""
    fields = {**LLAMA_FIELDS, "tokenizer.ggml.tokens": [f"t{i}" for i in range(262144)]}
    path = write_fields(tmp_path / "big.gguf", "llama", fields, ("token_embd.weight",))
    header = read_gguf_header(path, lambda key: not key.startswith("tokenizer.ggml.tokens"))
    assert "tokenizer.ggml.tokens" not in header.fields
    assert header.array_lengths["tokenizer.ggml.tokens"] == 262144
    assert gguf_config(path).vocab_size == 262144
