"""Read a transformers config into a ModelSpec; refuse anything the network does not implement."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ifb.builder.errors import UnsupportedModelError
from ifb.runtime.engine_format import Activation, ModelSpec

GEMMA2 = "gemma2"
GEMMA3 = "gemma3_text"
GEMMA_ARCHITECTURES = (GEMMA2, GEMMA3)
# model_type -> whether q/k/v projections carry a bias
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "llama": False,  # Llama 2/3, SmolLM/SmolLM2, TinyLlama
    "mistral": False,
    "qwen2": True,
    "qwen3": False,  # dense Qwen3 (0.6B-32B): per-head q/k RMSNorm, no bias
    "smollm3": False,  # SmolLM3: Llama with every 4th layer's RoPE left out (NoPE)
    "phi3": False,  # Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv and gate_up, LongRoPE, partial rotary
    GEMMA2: False,  # Gemma 2: Gemma 3's layout less q/k norms, one RoPE base, soft-capped scores and logits
    GEMMA3: False,  # Gemma 3 text: local (windowed) and global layers, GeGLU, (1 + w) norms
}
QK_NORM_ARCHITECTURES = ("qwen3", GEMMA3)
# transformers applies these configs' `sliding_window` on every layer (the network honours it);
WINDOW_ARCHITECTURES = ("mistral", "phi3")
# these on the layers `layer_types` names only (ModelSpec.full_attention_layers: the others)
LAYER_TYPES_WINDOW_ARCHITECTURES = ("qwen2", "qwen3", "smollm3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
# Whose transformers attention gives q/k/v *and* o_proj a bias when `attention_bias` is set
# (Qwen2's q/k/v bias is fixed, its o_proj has none; Mistral's and Phi-3's layers never do)
CONFIG_ATTENTION_BIAS_ARCHITECTURES = ("llama", "qwen3", "smollm3", GEMMA2, GEMMA3)
# Whose transformers MLP gives gate/up/down a bias when `mlp_bias` is set
CONFIG_MLP_BIAS_ARCHITECTURES = ("llama", "smollm3")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a transformers PretrainedConfig; refuse anything the network does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = getattr(config, "architectures", None) or [model_type]
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} (model_type={model_type!r}) is not supported; "
            f"supported model types: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    rope = global_rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if model_type in GEMMA_ARCHITECTURES:
        return _gemma_spec(config, _common_spec(config))
    if getattr(config, "hidden_act", "silu") != Activation.SILU:
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported; only 'silu'")
    spec = _common_spec(config)
    return _layer_types_window(config, spec) if model_type in LAYER_TYPES_WINDOW_ARCHITECTURES else spec


def _layer_types_window(config: Any, spec: ModelSpec) -> ModelSpec:
    """Qwen2/Qwen3/SmolLM3: `sliding_window` on the layers `layer_types` calls sliding, where
    `use_sliding_window` is set (as their transformers attention: the window is None otherwise)."""
    sliding = _sliding_layers(config)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    window = _checked_window(config, window)
    if not sliding or window is None:
        return spec
    full = tuple(i for i in range(spec.num_layers) if i not in sliding)
    return replace(spec, sliding_window=window, full_attention_layers=full)


def global_rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE parameters of the layers that take the engine's stored inv_freq: Gemma 3 keeps
    one dict per layer type (its full-attention layers' here), every other model one dict."""
    rope = getattr(config, "rope_parameters", None) or {}
    if config.model_type == GEMMA3:
        return dict(rope.get(gemma3_global_layer_type(config)) or {})
    return dict(rope)


def gemma3_global_layer_type(config: Any) -> str:
    """The layer type whose RoPE the stored inv_freq holds: the full-attention layers', or the
    sliding ones' where every layer slides (then no second table)."""
    return "full_attention" if "full_attention" in (config.layer_types or ()) else "sliding_attention"


def _sliding_layers(config: Any) -> list[int]:
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or ()) if kind == "sliding_attention"]


def _gemma_spec(config: Any, spec: ModelSpec) -> ModelSpec:
    """Gemma 2 and Gemma 3 text (transformers' Gemma2Model, Gemma3TextModel): interleaved local
    (sliding-window) and global layers, soft-capping where the config sets it (every Gemma 2;
    None in Gemma 3's releases); Gemma 3's local layers rotate by their own RoPE base. Refuses
    what the network does not apply."""
    name = config.model_type
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{name} use_bidirectional_attention is not supported (causal only)")
    activation = getattr(config, "hidden_activation", None) or Activation.GELU_TANH.value
    if activation != Activation.GELU_TANH:
        raise UnsupportedModelError(
            f"{name} hidden_activation {activation!r} is not supported; only 'gelu_pytorch_tanh'"
        )
    sliding = _sliding_layers(config)
    window = _checked_window(config, config.sliding_window) if sliding else None
    full = tuple(i for i in range(spec.num_layers) if i not in sliding)
    return replace(
        spec,
        sliding_window=window,
        full_attention_layers=full if window is not None else (),
        local_rope_theta=_gemma3_local_rope_theta(config, sliding, full) if name == GEMMA3 else None,
        hidden_act=Activation.GELU_TANH,
        norm_weight_offset=1.0,
        embed_scale=float(spec.hidden_size) ** 0.5,
        sandwich_norms=True,
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        attn_logit_softcap=_softcap(config, "attn_logit_softcapping"),
        final_logit_softcap=_softcap(config, "final_logit_softcapping"),
    )


def _gemma3_local_rope_theta(config: Any, sliding: list[int], full: tuple[int, ...]) -> float | None:
    """The sliding layers' RoPE base (rope_local_base_freq), where both kinds of layer exist."""
    local_rope = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
    if sliding and local_rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(
            f"gemma3 sliding layers' rope_type {local_rope['rope_type']!r} is not supported; only 'default'"
        )
    return float(local_rope["rope_theta"]) if sliding and full else None


def _softcap(config: Any, field: str) -> float | None:
    value = getattr(config, field, None)
    if value is None:
        return None
    if float(value) <= 0:
        raise UnsupportedModelError(f"{config.model_type} {field} must be > 0 (or null: none), got {value}")
    return float(value)


def _common_spec(config: Any) -> ModelSpec:
    model_type = config.model_type
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    config_bias = model_type in CONFIG_ATTENTION_BIAS_ARCHITECTURES and bool(getattr(config, "attention_bias", False))
    mlp_bias = model_type in CONFIG_MLP_BIAS_ARCHITECTURES and bool(getattr(config, "mlp_bias", False))
    return ModelSpec(
        architecture=model_type,
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
        attention_bias=SUPPORTED_ARCHITECTURES[model_type] or config_bias,
        bos_token_id=getattr(config, "bos_token_id", None),
        eos_token_ids=_eos_ids(getattr(config, "eos_token_id", None)),
        qk_norm=model_type in QK_NORM_ARCHITECTURES,
        no_rope_layers=_no_rope_layers(config),
        sliding_window=_sliding_window(config),
        attention_out_bias=config_bias,
        mlp_bias=mlp_bias,
    )


def _sliding_window(config: Any) -> int | None:
    """Mistral's and Phi-3's window (4096 for Mistral 7B v0.1, 2047 for Phi-3's 4k models, none
    for later Mistrals): each query attends to its last `window` keys, on every layer, as
    transformers' MistralModel and Phi3Model mask them."""
    window = getattr(config, "sliding_window", None) if config.model_type in WINDOW_ARCHITECTURES else None
    return _checked_window(config, window)


def _checked_window(config: Any, window: Any) -> int | None:
    """A config's sliding_window as the network takes it: None or 0 is no window; < 0 is refused."""
    if window is not None and int(window) < 0:
        raise UnsupportedModelError(f"{config.model_type} sliding_window must be >= 0 (0: none), got {window}")
    return int(window) if window else None


def _no_rope_layers(config: Any) -> tuple[int, ...]:
    """SmolLM3's `no_rope_layers` is a 0/1 per layer, 1 = uses RoPE; we record the 0s' indices."""
    flags = getattr(config, "no_rope_layers", None) if config.model_type == "smollm3" else None
    return tuple(index for index, uses_rope in enumerate(flags or ()) if not uses_rope)
