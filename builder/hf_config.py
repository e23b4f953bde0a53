"""Read a transformers config into a ModelSpec through its family (builder/families/); refuse
anything the network does not implement."""

from __future__ import annotations

from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families import family_of
from ifb.builder.families.family import SUPPORTED_ROPE_TYPES
from ifb.runtime.engine_format import ModelSpec


def model_spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a transformers PretrainedConfig; refuse anything the network does not implement."""
    family = family_of(getattr(config, "model_type", None), getattr(config, "architectures", None))
    rope_type = family.global_rope_parameters(config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return family.model_spec(config)
