"""The family registry (builder/families/): one entry per family, found by model_type or by GGUF
architecture, unknown names refused by name, and no code outside the folder branching on a
family's name (what the registry exists for: adding a family touches its own file only)."""

from __future__ import annotations

import ast
from pathlib import Path

import gguf
import numpy as np
import pytest

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.families import FAMILIES, family_of, gguf_family
from ifb.builder.sources import gguf_config

ROOT = Path(__file__).resolve().parents[2]
FAMILY_NAMES = {name for family in FAMILIES.values() for name in (family.model_type, family.gguf_architecture) if name}
# String literals equal to a family's name that are not a branch on the family, and why
NOT_FAMILY_BRANCHES = {
    ("builder/gguf_tokenizer.py", "llama"): "tokenizer.ggml.model 'llama' is SentencePiece, not the family",
    ("builder/gguf_tokenizer.py", "gemma"): "transformers' GemmaTokenizer's special tokens, a tokenizer class",
    ("builder/gguf_tokenizer.py", "qwen2"): "tokenizer.ggml.pre 'qwen2', a pre-tokenizer's name",
    ("runtime/reasoning.py", "qwen3"): "--reasoning-parser qwen3, a parser's name",
    ("runtime/server/tool_parsers.py", "mistral"): "the mistral tool-call parser's name",
}


def test_the_twelve_families_are_registered_under_their_model_type() -> None:
    assert set(FAMILIES) == {
        "llama",
        "mistral",
        "mixtral",
        "olmoe",
        "gpt_oss",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "phi3",
        "gemma2",
        "gemma3_text",
    }
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert family_of(model_type) is family
        if family.gguf_architecture is not None:
            assert gguf_family(family.gguf_architecture) is family
    assert gguf_family("llama") is FAMILIES["llama"]  # Mistral, Mixtral are written as Llama: no GGUF name of their own


@pytest.mark.parametrize("name", ["falcon", "gptneox", "mamba"])
def test_an_unknown_gguf_architecture_is_refused_by_name(name: str) -> None:
    with pytest.raises(
        UnsupportedModelError, match=f"GGUF architecture '{name}' is not supported( \\(.*\\))?; supported: "
    ):
        gguf_family(name)


def test_an_unknown_model_type_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel' \(model_type='gpt2'\).*qwen3"):
        family_of("gpt2", ["GPT2LMHeadModel"])


def test_a_gguf_of_an_unknown_architecture_is_refused_before_transformers_reads_it(tmp_path: Path) -> None:
    """transformers' own message for such a file is a ValueError about its GGUF support; ours names
    the architecture and what is supported."""
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'falcon' is not supported"):
        gguf_config(path)


def _family_name_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in FAMILY_NAMES | {"gemma"}
    }


def test_no_code_outside_the_families_folder_branches_on_a_family_name() -> None:
    found = {
        (str(path.relative_to(ROOT)), literal)
        for folder in ("builder", "runtime", "plugins", "cli", "ifb")
        for path in (ROOT / folder).rglob("*.py")
        if "families" not in path.relative_to(ROOT).parts
        for literal in _family_name_literals(path)
    }
    assert found - set(NOT_FAMILY_BRANCHES) == set(), "family names outside builder/families/"
