"""The model families ifb builds, one module each, and the one registry that finds them.

A source's family is found by its HF config's `model_type` or its GGUF's `general.architecture`;
everything the builder knows of that family (config -> ModelSpec, GGUF keys and tensor names,
fixes and refusals) is its class. Adding a family: docs/design.md §7.
"""

from __future__ import annotations

from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families.family import Family, VocabularyStyle, WindowRule
from ifb.builder.families.gemma2 import Gemma2
from ifb.builder.families.gemma3 import Gemma3
from ifb.builder.families.gpt_oss import GptOss
from ifb.builder.families.llama import Llama
from ifb.builder.families.mistral import Mistral
from ifb.builder.families.mixtral import Mixtral
from ifb.builder.families.olmoe import Olmoe
from ifb.builder.families.phi3 import Phi3
from ifb.builder.families.qwen2 import Qwen2
from ifb.builder.families.qwen3 import Qwen3
from ifb.builder.families.qwen3moe import Qwen3Moe
from ifb.builder.families.smollm3 import SmolLM3

__all__ = ["FAMILIES", "Family", "VocabularyStyle", "WindowRule", "family_of", "gguf_family"]

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Llama(),
        Mistral(),
        Mixtral(),
        Qwen2(),
        Qwen3(),
        Qwen3Moe(),
        Olmoe(),
        GptOss(),
        SmolLM3(),
        Phi3(),
        Gemma2(),
        Gemma3(),
    )
}
# Mixtures of experts the network does not implement, by model_type and GGUF architecture: why
_SHARED_EXPERTS = "a mixture of experts with shared experts beside the routed ones"
_DEEPSEEK = "a mixture of experts with DeepSeek's group-limited routing and shared experts"
_LLAMA4 = "a mixture of experts whose MoE layers interleave with dense ones, with a shared expert"
REFUSED_MOE: dict[str, str] = {
    "qwen2_moe": _SHARED_EXPERTS,
    "qwen2moe": _SHARED_EXPERTS,
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "deepseek2": _DEEPSEEK,
    "llama4": _LLAMA4,
    "llama4_text": _LLAMA4,
}
_BY_GGUF_ARCHITECTURE: dict[str, Family] = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}


def family_of(model_type: str | None, architectures: list[str] | None = None) -> Family:
    """The family of a transformers config's model_type; refused by name when there is none."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        shown = (architectures or [str(model_type)])[0]
        refused = REFUSED_MOE.get(model_type or "")
        reason = f" ({refused})" if refused else ""
        raise UnsupportedModelError(
            f"architecture {shown!r} (model_type={model_type!r}) is not supported{reason}; "
            f"supported model types: {', '.join(sorted(FAMILIES))}"
        )
    return family


def gguf_family(architecture: str, reader: Any = None) -> Family:
    """The family of a GGUF's `general.architecture`, or with the file's `reader`, of the file
    (a `llama` file with experts is a Mixtral); refused by name when there is none."""
    family = _BY_GGUF_ARCHITECTURE.get(architecture)
    if family is None:
        refused = REFUSED_MOE.get(architecture)
        reason = f" ({refused})" if refused else ""
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} is not supported{reason}; "
            f"supported: {', '.join(sorted(_BY_GGUF_ARCHITECTURE))}"
        )
    variant = family.gguf_variant(reader) if reader is not None else None
    return FAMILIES[variant] if variant is not None else family


def vocabulary_style(gguf_architecture: str) -> VocabularyStyle:
    """How a GGUF's SentencePiece vocabulary becomes a tokenizer (Llama's where the family is unknown)."""
    family = _BY_GGUF_ARCHITECTURE.get(gguf_architecture)
    return family.vocabulary if family is not None else VocabularyStyle.LLAMA


def register_llama_shaped_gguf_architectures() -> None:
    """Teach transformers' GGUF reader (config, tokenizer, weights) the names llama.cpp writes
    exactly as Llama that it does not list (SmolLM3): read with the Llama tables; and the config
    keys of those whose family states them (OLMoE: its config only, ifb reads its tensors)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations import ggml

    for family in FAMILIES.values():
        if family.gguf_config_keys is not None:
            ggml.GGUF_CONFIG_MAPPING.setdefault(family.gguf_name, dict(family.gguf_config_keys))
            if family.gguf_name not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
                gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append(family.gguf_name)
        if not family.llama_shaped_gguf:
            continue
        name = family.gguf_name
        ggml.GGUF_CONFIG_MAPPING.setdefault(name, ggml.GGUF_CONFIG_MAPPING["llama"])
        gguf_utils.TENSOR_PROCESSORS.setdefault(name, gguf_utils.TENSOR_PROCESSORS["llama"])
        if name not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
            gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append(name)
