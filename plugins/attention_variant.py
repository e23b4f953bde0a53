"""AttentionVariant: what makes one layer's attention differ from plain causal softmax attention.

One contract for every attention path (the kernel op, the torch paths, the reference): the scalar
fields below, plus the layer's sink logits passed beside them as a tensor (gpt-oss; a weight,
not a constant). The kernel op `ifb_quant::paged_attention` takes the fields as one string of
named values (`kernel_fields`), so a new field is a field here, a name in the binding's parser
and a branch in the kernel: no new op, no new C signature, and a compiled step built before the
field keeps calling the same shim. Torch-free, so engine files and tests can build one.

- `window` (Mistral's, Phi-3's, Gemma's and gpt-oss's sliding layers): a query at position i
  attends to key positions p with i - window < p <= i, as transformers' sliding_window_overlay
  (`kv_idx > q_idx - sliding_window`); None attends to every earlier key.
- `softcap` (Gemma 2's attn_logit_softcapping): each scaled score s becomes cap * tanh(s / cap)
  before the mask and softmax, as transformers' eager attention; None leaves scores as they are.
- sinks (gpt-oss, the tensor beside the variant): a logit per query head that joins the softmax
  (its max and its denominator) and weights no value, as transformers' GptOss eager attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionVariant:
    window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window <= 0:
            raise ValueError(f"an attention window must be a positive number of keys, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"an attention softcap must be > 0, got {self.softcap}")

    def kernel_fields(self) -> str:
        """The kernel op's `variant` argument: `name=value` fields joined by ';' ('' = plain).
        The float is written by repr, which round-trips exactly through the binding's stod.
        Formatted once per variant: the eager step asks for it per layer and step."""
        return _kernel_fields(self)


@functools.cache
def _kernel_fields(variant: AttentionVariant) -> str:
    fields = []
    if variant.window is not None:
        fields.append(f"window={variant.window}")
    if variant.softcap is not None:
        fields.append(f"softcap={float(variant.softcap)!r}")
    return ";".join(fields)


PLAIN = AttentionVariant()
