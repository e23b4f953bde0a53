"""Family: what ifb knows of one model family, from its HF config and its GGUF file to a ModelSpec.

A family is one subclass of `Family` in its own module of this folder, registered in
`__init__.py`. The class attributes are its facts (which biases, which norms, how llama.cpp's
converter wrote its tensors); the methods its readings (HF config -> ModelSpec, a GGUF's keys ->
the HF config, RoPE tables). Every default here is Llama's, so a family states only how it
differs. The network and the kernels read only the ModelSpec; nothing outside this folder branches
on a family's name (docs/design.md §7 says how to add one).
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from enum import Enum
from typing import Any, ClassVar

import torch

from ifb.builder.errors import UnsupportedModelError
from ifb.builder.gguf_metadata import (
    ROPE_FREQS_TENSOR,
    declared_biases,
    field_value,
    rope_freq_factors,
    rope_scaling_parameters,
)
from ifb.plugins.quant_formats import WeightFormat
from ifb.runtime.engine_format import Activation, ModelSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")

# Our module name -> the tensors (per layer) whose rows it concatenates, in order
HF_LAYER_LINEARS: dict[str, tuple[str, ...]] = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down": ("mlp.down_proj",),
}
GGUF_LAYER_LINEARS: dict[str, tuple[str, ...]] = {
    "attn.qkv": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up": ("ffn_gate", "ffn_up"),
    "mlp.down": ("ffn_down",),
}
# Our norm name -> the tensor (per layer) holding its weight
HF_LAYER_NORMS: dict[str, str] = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
GGUF_LAYER_NORMS: dict[str, str] = {"input_norm": "attn_norm", "post_norm": "ffn_norm"}


class WindowRule(str, Enum):
    """Where a config's `sliding_window` applies, as the family's transformers attention applies it."""

    NONE = "none"  # never (Llama: the key is not the model's)
    EVERY_LAYER = "every_layer"  # every layer (Mistral, Phi-3)
    LAYER_TYPES = "layer_types"  # the layers `layer_types` calls sliding, where `use_sliding_window` is set


class VocabularyStyle(str, Enum):
    """How a GGUF's SentencePiece vocabulary is turned into a tokenizer, as transformers' conversion
    does for the family (builder/gguf_tokenizer.py); byte-level vocabularies are one kind for all."""

    LLAMA = "llama"  # Metaspace pre-tokenizer, prefix space on the first word
    PHI3 = "phi3"  # the prefix space from a normalizer, as Phi-3's tokenizer.json
    GEMMA = "gemma"  # spaces as ▁ by a normalizer, merges from the file's order


class Family:
    """One model family. Subclasses set the class attributes that differ from Llama's and override
    the readings that do; instances are stateless and live in the registry."""

    model_type: ClassVar[str]  # transformers' config.model_type: the registry key, ModelSpec.architecture
    gguf_architecture: ClassVar[str | None] = None  # llama.cpp's general.architecture; None: none of its own
    releases: ClassVar[str] = ""  # what people run of it (README, messages)

    # --- the HF config
    qkv_bias: ClassVar[bool] = False  # q/k/v carry a bias whatever the config says (Qwen2)
    config_attention_bias: ClassVar[bool] = False  # `attention_bias` gives q, k, v and o a bias
    config_mlp_bias: ClassVar[bool] = False  # `mlp_bias` gives gate, up and down a bias
    qk_norm: ClassVar[bool] = False  # each head's q and k RMS-normalized before RoPE
    window: ClassVar[WindowRule] = WindowRule.NONE

    # --- the GGUF file, as llama.cpp's converter writes it
    gguf_keys: ClassVar[tuple[str, ...]] = ()  # `{arch}.*` keys read beyond every family's (gguf_metadata)
    gguf_permuted_qk: ClassVar[bool] = False  # attn_q/attn_k rows permuted for llama.cpp's rotary layout
    gguf_norm_offset: ClassVar[float] = 0.0  # norm weights stored as (offset + w); taken off on reading
    rope_freqs: ClassVar[bool] = False  # `rope_freqs.weight` (Llama 3's scaling as factors) may be applied
    config_tensors: ClassVar[tuple[str, ...]] = ()  # tensors read into the config (RoPE factors), not weights
    llama_shaped_gguf: ClassVar[bool] = False  # written exactly as Llama; transformers' reader lacks the name
    # transformers' GGUF reader lacks the name, and its `{arch}.*` keys -> the config's fields are
    # these (OLMoE); None: the reader knows the name, or llama_shaped_gguf says how to read it
    gguf_config_keys: ClassVar[dict[str, str | None] | None] = None
    vocabulary: ClassVar[VocabularyStyle] = VocabularyStyle.LLAMA

    # --- tensor names
    hf_layer_linears: ClassVar[dict[str, tuple[str, ...]]] = HF_LAYER_LINEARS
    gguf_layer_linears: ClassVar[dict[str, tuple[str, ...]]] = GGUF_LAYER_LINEARS
    hf_layer_norms: ClassVar[dict[str, str]] = HF_LAYER_NORMS
    gguf_layer_norms: ClassVar[dict[str, str]] = GGUF_LAYER_NORMS
    # A mixture of experts: our stacked expert weight (per layer) -> the tensors whose rows it
    # concatenates per expert: HF names with `{e}` for the expert, GGUF names of stacked tensors
    hf_layer_experts: ClassVar[dict[str, tuple[str, ...]]] = {}
    gguf_layer_experts: ClassVar[dict[str, tuple[str, ...]]] = {}
    # HF checkpoints holding each layer's experts as one stacked tensor (gpt-oss), named in
    # hf_layer_experts without `{e}` and read expert by expert through `hf_stacked_expert`
    hf_experts_stacked: ClassVar[bool] = False
    # ...which may be stored as blocks: (blocks tensor suffix, scales tensor suffix, format) beside
    # the stacked name (gpt-oss's released checkpoints: `_blocks`/`_scales`, MXFP4)
    hf_expert_blocks: ClassVar[tuple[str, str, WeightFormat] | None] = None
    # Per-layer tensors beyond the norms and linear biases (gpt-oss: sinks, router and expert
    # biases): our name under `layers.{i}.` -> the source's full names under `model.layers.{i}.`
    # or `blk.{i}.`, concatenated (a bias along its last dim: per expert where it is [E, n])
    hf_layer_dense: ClassVar[dict[str, tuple[str, ...]]] = {}
    gguf_layer_dense: ClassVar[dict[str, tuple[str, ...]]] = {}

    # ----------------------------------------------------------------- HF config -> ModelSpec
    def model_spec(self, config: Any) -> ModelSpec:
        """The config as the network takes it; refuses what the network does not implement."""
        activation = getattr(config, "hidden_act", Activation.SILU.value)
        if activation != Activation.SILU:
            raise UnsupportedModelError(f"hidden_act {activation!r} is not supported; only 'silu'")
        return self.windowed(config, self.common_spec(config))

    def common_spec(self, config: Any) -> ModelSpec:
        """The shapes and constants every family's config states the same way."""
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        config_bias = self.config_attention_bias and bool(getattr(config, "attention_bias", False))
        return ModelSpec(
            architecture=self.model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=self.qkv_bias or config_bias,
            bos_token_id=getattr(config, "bos_token_id", None),
            eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
            qk_norm=self.qk_norm,
            attention_out_bias=config_bias,
            mlp_bias=self.config_mlp_bias and bool(getattr(config, "mlp_bias", False)),
        )

    def windowed(self, config: Any, spec: ModelSpec) -> ModelSpec:
        """The spec with the config's `sliding_window` where the family's attention applies it."""
        if self.window is WindowRule.EVERY_LAYER:
            # Mistral's 4096 (7B v0.1; none in later ones), Phi-3 4k's 2047: every layer, as
            # transformers' MistralModel and Phi3Model mask them
            return replace(spec, sliding_window=checked_window(config, getattr(config, "sliding_window", None)))
        if self.window is WindowRule.LAYER_TYPES:
            sliding = sliding_layers(config)
            window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
            window = checked_window(config, window)
            if not sliding or window is None:
                return spec
            full = tuple(i for i in range(spec.num_layers) if i not in sliding)
            return replace(spec, sliding_window=window, full_attention_layers=full)
        return spec

    def global_rope_parameters(self, config: Any) -> dict[str, Any]:
        """The RoPE parameters of the layers that take the engine's stored inv_freq."""
        return dict(getattr(config, "rope_parameters", None) or {})

    def rope_init(self, config: Any, max_seq_len: int) -> tuple[torch.Tensor, float]:
        """inv_freq and attention scaling by transformers' own init for the config's rope_type.
        Plain RoPE comes from the family's own rotary class, so Phi-3's partial_rotary_factor
        shortens the table as it does there (Llama's ignores the factor). LongRoPE takes its long
        factors for an engine whose max_seq_len passes original_max_position_embeddings, for every
        position, as llama.cpp does for such a context (transformers switches per call by the
        sequence's length, so on prompts shorter than the original window such an engine differs
        from it)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = self.global_rope_parameters(config).get("rope_type", "default")
        if rope_type == "default":
            result: tuple[torch.Tensor, float] = self.rotary_class().compute_default_rope_parameters(config)
            return result
        if rope_type == "longrope":
            return ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=max_seq_len)  # type: ignore[no-any-return]
        return ROPE_INIT_FUNCTIONS[rope_type](config, None)  # type: ignore[no-any-return]

    def rotary_class(self) -> Any:
        """The family's transformers rotary-embedding class (LlamaRotaryEmbedding, Phi3RotaryEmbedding, ...)."""
        name = self.model_type.removesuffix("_text")
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        classes = [
            value
            for attribute, value in vars(module).items()
            if attribute.endswith("RotaryEmbedding") and hasattr(value, "compute_default_rope_parameters")
        ]
        if len(classes) != 1:
            raise UnsupportedModelError(f"cannot tell {self.model_type}'s rotary embedding in transformers: {classes}")
        return classes[0]

    # ------------------------------------------------------------ HF checkpoint tensors
    def hf_stacked_expert(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """One expert's slice of the stacked checkpoint tensor `name` as our rows [n, k]
        (hf_experts_stacked families only)."""
        raise NotImplementedError(f"{self.model_type} holds no stacked experts")

    def hf_stacked_expert_blocks(self, name: str, blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """One expert's slices of the blocks tensor `name` and its scales as GGUF rows of blocks
        uint8 [n, k / block_weights * block_bytes], our row order (hf_expert_blocks families only)."""
        raise NotImplementedError(f"{self.model_type} holds no expert blocks")

    def read_hf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as the network takes it (gpt-oss: interleaved gate/up biases split)."""
        return tensor

    # ------------------------------------------------------------ a GGUF's keys -> HF config
    def read_gguf(self, config: Any, reader: Any) -> Any:
        """What llama.cpp's graph reads of the file and transformers' GGUF reader leaves at its
        defaults, written into `config` (transformers' config of the file); may return a config of
        another family (a Llama file with a window is a Mistral)."""
        self.read_rotary_dims(config, reader)
        self.read_rope_scaling(config, reader)
        config.rope_freq_factors = rope_freq_factors(reader, self.gguf_name, applied=self.rope_freqs)
        if self.config_attention_bias:
            config.update(declared_biases(reader, self.config_mlp_bias))
        return self.read_window(config, reader)

    def gguf_variant(self, reader: Any) -> str | None:
        """The model_type of the family a file of this GGUF architecture really is, where that is
        another's (a `llama` file with experts is a Mixtral); None: this family's."""
        return None

    @property
    def gguf_name(self) -> str:
        return self.gguf_architecture or self.model_type

    @property
    def gguf_config_tensors(self) -> tuple[str, ...]:
        """The file's tensors that `read_gguf` reads into the config rather than the network."""
        return ((ROPE_FREQS_TENSOR,) if self.rope_freqs else ()) + self.config_tensors

    def read_rotary_dims(self, config: Any, reader: Any) -> None:
        """Refuse a file whose `rope.dimension_count` is not its head size: transformers' classes of
        this family rotate every dim."""
        dims = field_value(reader, f"{self.gguf_name}.rope.dimension_count")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if dims is not None and int(dims) != head_dim:
            raise UnsupportedModelError(
                f"GGUF {self.gguf_name}.rope.dimension_count = {int(dims)} (partial rotary) is not supported "
                f"on {self.gguf_name}: its head size is {head_dim}"
            )

    def read_rope_scaling(self, config: Any, reader: Any) -> None:
        config.rope_parameters = {**config.rope_parameters, **rope_scaling_parameters(reader, self.gguf_name)}

    def read_window(self, config: Any, reader: Any) -> Any:
        """`{arch}.attention.sliding_window` (0 or absent: none), which transformers' GGUF reader does
        not map, where the family applies it on every layer."""
        if self.window is WindowRule.EVERY_LAYER:
            config.sliding_window = gguf_window(reader, self.gguf_name) or None
        return config

    def transformers_load_config(self, config: Any) -> Any:
        """The config under which transformers' GGUF loader reads the file's tensors (oracles only)."""
        return config


def gguf_window(reader: Any, architecture: str) -> int:
    value = field_value(reader, f"{architecture}.attention.sliding_window")
    return int(value) if value is not None else 0


def checked_window(config: Any, window: Any) -> int | None:
    """A config's sliding_window as the network takes it: None or 0 is no window; < 0 is refused."""
    if window is not None and int(window) < 0:
        raise UnsupportedModelError(f"{config.model_type} sliding_window must be >= 0 (0: none), got {window}")
    return int(window) if window else None


def sliding_layers(config: Any) -> list[int]:
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind == "sliding_attention"]


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
