"""ModelSpec: the architecture facts of a model, as an engine records them in engine.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any


class RouterScoring(str, Enum):
    """How a mixture of experts' router turns its logits into the top-k experts' weights."""

    SOFTMAX_TOP_K = "softmax_top_k"  # softmax over every expert, the top k kept (Qwen3-MoE, OLMoE, Mixtral)
    TOP_K_SOFTMAX = "top_k_softmax"  # the top k logits, softmax over those k (gpt-oss)


class Activation(str, Enum):
    """The MLP gate's activation, by transformers' name (engine.json stores the value)."""

    SILU = "silu"  # SwiGLU: Llama, Qwen, Mistral, Phi-3, SmolLM3
    GELU_TANH = "gelu_pytorch_tanh"  # GeGLU with gelu's tanh approximation: Gemma 2/3


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shapes and constants of a Llama-family decoder (Qwen2/3 included); everything the network
    needs to exist."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Qwen3: each head's q and k are RMS-normalized (a weight of head_dim each) before RoPE.
    # Defaulted so engine.json records written before the field still read.
    qk_norm: bool = False
    # OLMoE: those norms span all of q's heads together (one weight of num_heads * head_dim) and
    # all of k's (num_kv_heads * head_dim), as its transformers attention norms the whole projection
    qk_norm_across_heads: bool = False
    # SmolLM3: the layers (by index) whose attention takes no rotary embedding (every 4th there)
    no_rope_layers: tuple[int, ...] = ()
    # Mistral, Phi-3: the attention window its checkpoint declares, on every layer: a query at
    # position i attends to keys at positions p with i - sliding_window < p <= i (transformers'
    # sliding-window causal mask). None: every earlier key. Engines built before the network
    # honoured it (Phi-3 only) had max_seq_len <= sliding_window, where the window cuts nothing.
    sliding_window: int | None = None
    # Gemma 3: the layers the window skips (its global layers); every other layer slides
    full_attention_layers: tuple[int, ...] = ()
    # Gemma 3: the RoPE base of the sliding layers (rope_local_base_freq; default RoPE, no
    # scaling); the full-attention layers take the engine's stored inv_freq. None: one table.
    local_rope_theta: float | None = None
    # Gemma 3's other differences from Llama, each defaulted to Llama's behaviour
    hidden_act: Activation = Activation.SILU
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight), in fp32 (Gemma: 1)
    embed_scale: float | None = None  # embeddings times this, rounded to the model dtype (sqrt(hidden))
    sandwich_norms: bool = False  # an RMSNorm on the attention's and on the MLP's output too
    attention_scale: float | None = None  # query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    # Gemma 2's soft-capping: attention scores and final logits x become cap * tanh(x / cap)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # gpt-oss: each query head has a learned sink logit that joins its softmax's max and
    # denominator and weights no value (the layer's `sinks` weight, [num_heads], fp32)
    attention_sinks: bool = False
    # Biases beyond q/k/v's (attention_bias): o_proj's (Llama, Qwen3, SmolLM3, Gemma with
    # `attention_bias: true`) and the MLP's gate/up/down (Llama, SmolLM3 with `mlp_bias: true`)
    attention_out_bias: bool = False
    mlp_bias: bool = False
    # Mixtures of experts (Qwen3-MoE): every layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size; a router (softmax over the experts) picks num_experts_per_tok per
    # token, their probabilities renormalized to sum 1 where norm_topk_prob. 0 experts: dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # gpt-oss's differences: the router's scoring and its bias, biases on every expert's gate/up
    # and down outputs, and the experts' SwiGLU clamped: gate = min(gate, swiglu_limit), up =
    # clamp(up, -swiglu_limit, swiglu_limit), (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    # (None: silu(gate) * up)
    router_scoring: RouterScoring = RouterScoring.SOFTMAX_TOP_K
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index` (None: every earlier key)."""
        return None if index in self.full_attention_layers else self.sliding_window

    def uses_local_rope(self, index: int) -> bool:
        """Whether layer `index` rotates by the local (sliding-layer) table."""
        return self.local_rope_theta is not None and index not in self.full_attention_layers

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        data["eos_token_ids"] = tuple(data["eos_token_ids"])
        data["no_rope_layers"] = tuple(data.get("no_rope_layers", ()))
        data["full_attention_layers"] = tuple(data.get("full_attention_layers", ()))
        data["hidden_act"] = Activation(data.get("hidden_act", Activation.SILU))
        data["router_scoring"] = RouterScoring(data.get("router_scoring", RouterScoring.SOFTMAX_TOP_K))
        return cls(**data)
