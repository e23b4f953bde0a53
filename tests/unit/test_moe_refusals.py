"""The mixtures of experts ifb does not run are refused by name, saying why, from an HF config
and from a GGUF alike; those it runs refuse what their network lacks (shared experts in a file
of a family that reads experts)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families import FAMILIES, family_of, gguf_family
from ifb.builder.gguf_metadata import refuse_unread_keys

# model_type or GGUF architecture -> what its message must say
REASONS = {
    "qwen2_moe": "shared experts",
    "deepseek_v3": "DeepSeek's group-limited routing",
    "llama4_text": "MoE layers interleave with dense ones",
}
GGUF_REASONS = {
    "qwen2moe": "shared experts",
    "deepseek2": "DeepSeek's group-limited routing",
    "llama4": "MoE layers interleave with dense ones",
}


@pytest.mark.parametrize("model_type", sorted(REASONS))
def test_an_unsupported_moe_config_is_refused_with_the_reason(model_type: str) -> None:
    with pytest.raises(
        UnsupportedModelError, match=rf"model_type='{model_type}'\) is not supported \(.*{REASONS[model_type]}"
    ):
        family_of(model_type, None)


@pytest.mark.parametrize("architecture", sorted(GGUF_REASONS))
def test_an_unsupported_moe_gguf_is_refused_with_the_reason(architecture: str) -> None:
    reason = GGUF_REASONS[architecture]
    with pytest.raises(
        UnsupportedModelError, match=rf"GGUF architecture '{architecture}' is not supported \(.*{reason}"
    ):
        gguf_family(architecture)


@pytest.mark.parametrize("architecture", ["olmoe", "llama"])
def test_shared_experts_in_a_file_of_a_moe_family_are_refused_by_name(architecture: str, tmp_path: Path) -> None:
    """An OLMoE file, or a Mixtral-style llama one, with a shared expert beside the routed ones."""
    path = tmp_path / "shared.gguf"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_tensor("blk.0.ffn_up_shexp.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    family = gguf_family(architecture, reader)
    assert family is FAMILIES["olmoe" if architecture == "olmoe" else "mixtral"]
    with pytest.raises(UnsupportedModelError, match=rf"{architecture} GGUF has shared experts \(blk.0.ffn_up_shexp"):
        refuse_unread_keys(reader, architecture, family.gguf_keys)


def test_a_dense_family_file_with_experts_is_refused_as_a_mixture_of_experts(tmp_path: Path) -> None:
    path = tmp_path / "qwen2-experts.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_expert_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    with pytest.raises(UnsupportedModelError, match=r"qwen2 GGUF is a mixture of experts \(qwen2.expert_count = 4"):
        refuse_unread_keys(reader, "qwen2", gguf_family("qwen2", reader).gguf_keys)
