"""A GGUF's transformers config read from its header alone, in milliseconds.

`AutoConfig.from_pretrained(gguf_file=...)` goes through transformers' `load_gguf_checkpoint`, which opens
the file with gguf's GGUFReader and parses every metadata element one by one (the vocabulary too): 23-28 s
for a 262k-token file on the 2-core machine, quiet. The config needs none of the vocabulary but its size,
so here the header is read by `gguf_fields` (vocabulary arrays walked past, their lengths kept) and the
config dict is made by the same steps as transformers' (its key tables, defaults and renames), then handed
to the same config class. tests/unit/test_gguf_config.py compares the two on every family's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ifb.builder.errors import SourceError
from ifb.builder.families import gguf_family, register_llama_shaped_gguf_architectures
from ifb.builder.families.transformers_gguf_names import transformers_architecture, transformers_model_type
from ifb.builder.gguf_fields import GgufHeader, read_gguf_header, without_vocabulary
from ifb.builder.gguf_metadata import field_value, refuse_unread_keys


def gguf_config(path: Path) -> Any:
    """transformers' config of a GGUF, with what llama.cpp's graph reads and transformers' GGUF
    reader leaves at defaults read in by the file's family (builder/families/): head_dim from
    `attention.key_length` (transformers' reader does not map it, so a Qwen3 GGUF got Qwen3Config's
    default 128 whatever the file says), RoPE scaling and factors, windows, soft-caps, biases."""
    header = read_gguf_header(path, without_vocabulary)
    architecture = field_value(header, "general.architecture")
    if not isinstance(architecture, str):
        raise SourceError(f"{path} has no general.architecture: not a model file llama.cpp would read")
    family = gguf_family(architecture, header)  # refuse by name before transformers' tables are asked
    register_llama_shaped_gguf_architectures()
    config = transformers_config(header, path)
    refuse_unread_keys(header, architecture, family.gguf_keys)
    key_length = field_value(header, f"{architecture}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    if getattr(config, "pad_token_id", None) is not None and not 0 <= config.pad_token_id < config.vocab_size:
        config.pad_token_id = None  # a config class's default (SmolLM3's 128004) where the file names none
    return family.read_gguf(config, header)


def transformers_config(header: GgufHeader, path: Path) -> Any:
    """What `AutoConfig.from_pretrained(path.parent, gguf_file=path.name)` returns for this header."""
    from transformers import CONFIG_MAPPING

    config_dict = transformers_config_dict(header, path)
    try:
        config_class = CONFIG_MAPPING[config_dict["model_type"]]
    except KeyError as error:
        raise SourceError(f"cannot read GGUF metadata of {path}: unknown model type {error}") from error
    try:
        return config_class.from_dict(config_dict, gguf_file=path.name, name_or_path=path.parent)
    except (ValueError, KeyError) as error:  # the config class's own checks of the values
        raise SourceError(f"cannot read GGUF metadata of {path}: {error}") from error


def transformers_config_dict(header: GgufHeader, path: Path) -> dict[str, Any]:
    """transformers' `load_gguf_checkpoint(path)["config"]`, step by step, from the header's values."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = header.fields["general.architecture"]
    updated = transformers_architecture(architecture, header.fields.get("general.name"))
    supported = gguf_utils.GGUF_SUPPORTED_ARCHITECTURES
    if architecture not in supported and updated not in supported:
        raise SourceError(f"cannot read GGUF metadata of {path}: architecture {architecture} is not supported")
    config: dict[str, Any] = {"tie_word_embeddings": all(t.name != "output.weight" for t in header.tensors)}
    defaults: dict[str, Any] = GGUF_CONFIG_DEFAULTS_MAPPING.get(
        updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
    )
    for key, default in defaults.items():
        config.setdefault(key, default)
    mapping: dict[str, Any] = GGUF_CONFIG_MAPPING
    for key, raw in header.fields.items():
        prefix, _, config_key = key.replace(architecture, updated).partition(".")
        renamed = mapping.get(prefix, {}).get(config_key, -1)
        if renamed == -1 or renamed is None:
            continue
        value: Any = raw.tolist() if isinstance(raw, np.ndarray) else raw
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers unwraps a one-element array as it does a scalar
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        config[renamed] = value
    config["model_type"] = transformers_model_type(config["model_type"])
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.array_lengths:
        config["vocab_size"] = header.array_lengths["tokenizer.ggml.tokens"]
    return config
