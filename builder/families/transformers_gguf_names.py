"""transformers' own renames of llama.cpp architecture names in its GGUF config reader
(`load_gguf_checkpoint`), kept beside the families because they name them. builder/gguf_config.py
repeats that reader's steps from the header alone; these are its name rules, in its order. The
t5/stablelm/lfm2/gemma4 special cases there are for architectures without a family here (refused
before the config is read)."""

from __future__ import annotations

# a substring of the file's architecture -> the name transformers' key tables use, checked in this order
_RENAMED = (("qwen2moe", "qwen2_moe"), ("gpt_oss", "gpt_oss"), ("gpt-oss", "gpt_oss"), ("qwen3moe", "qwen3_moe"))
# the file holds the text backbone only
_TEXT_MODEL_TYPES = {"gemma3": "gemma3_text"}


def transformers_architecture(architecture: str, name: str | None) -> str:
    """The architecture name transformers reads a file's keys under: a `llama` file whose `general.name`
    is exactly "mistral" (transformers compares its one-element name list) is read as Mistral."""
    renamed = "mistral" if "llama" in architecture and name == "mistral" else architecture
    return next((new for mark, new in _RENAMED if mark in architecture), renamed)


def transformers_model_type(model_type: str) -> str:
    """The config class transformers makes for the model type a file's keys give."""
    return _TEXT_MODEL_TYPES.get(model_type, model_type)
