"""MoeBlock (runtime/step/moe_block.py): which grouped op a spec's experts run as, and its routing.

Pins: plain SwiGLU experts without biases (Qwen3-MoE, OLMoE, Mixtral) still call
`ifb_quant::grouped_experts`, so an engine whose kernel library predates the variant op keeps
running eagerly; gpt-oss's (biases, clamped SwiGLU) call `grouped_experts_variant` with its fields.
gpt-oss's router takes the top k logits (bias included) and a softmax over those k; the others a
softmax over every expert, top k, renormalized where `norm_topk_prob`. A spec's new fields survive
engine.json, and a record written before them reads as the plain block.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from engine_records import SPEC
from torch.utils._python_dispatch import TorchDispatchMode

from ifb.plugins.quant_build import QuantLibrary
from ifb.runtime.engine_format import ModelSpec, RouterScoring
from ifb.runtime.step.moe_block import MoeBlock

MOE = replace(SPEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
GPT_OSS = replace(
    MOE,
    router_scoring=RouterScoring.TOP_K_SOFTMAX,
    router_bias=True,
    expert_bias=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
)


class _OpNames(TorchDispatchMode):
    """The names of the ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _block(spec: ModelSpec, seed: int = 0) -> MoeBlock:
    block = MoeBlock(spec)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block


@pytest.mark.parametrize(("spec", "op"), [(MOE, "grouped_experts"), (GPT_OSS, "grouped_experts_variant")])
def test_the_block_calls_the_plain_op_unless_its_experts_need_the_variant(
    quant_library: QuantLibrary, spec: ModelSpec, op: str
) -> None:
    with _OpNames() as recorded:
        _block(spec)(torch.randn(3, spec.hidden_size))
    experts_ops = [name for name in recorded.names if name.startswith("ifb_quant::")]
    assert experts_ops == [f"ifb_quant::{op}"], recorded.names


def test_gpt_oss_routing_is_a_softmax_over_the_top_k_logits_with_the_bias() -> None:
    block = _block(GPT_OSS, seed=1)
    x = torch.randn(5, GPT_OSS.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, weights = block.route(x)
    logits = x @ block.router.weight.T + block.router.bias
    top, expected_ids = logits.topk(2, dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights, torch.softmax(top, dim=-1), atol=1e-6)
    assert not torch.equal(ids, (x @ block.router.weight.T).topk(2, dim=-1).indices)  # the bias decides some


def test_the_plain_routing_is_a_softmax_over_every_expert_then_the_top_k() -> None:
    block = _block(MOE, seed=3)
    x = torch.randn(5, MOE.hidden_size, generator=torch.Generator().manual_seed(4))
    ids, weights = block.route(x)
    probs = torch.softmax(x @ block.router.weight.T, dim=-1)
    top, expected_ids = probs.topk(2, dim=-1)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights, top, atol=1e-6)  # not renormalized: norm_topk_prob is False


def test_the_spec_fields_survive_engine_json_and_old_records_read_plain() -> None:
    assert ModelSpec.from_json(GPT_OSS.to_json()) == GPT_OSS
    before = {key: value for key, value in MOE.to_json().items() if key not in _NEW_FIELDS}
    assert ModelSpec.from_json(before) == MOE


_NEW_FIELDS = ("router_scoring", "router_bias", "expert_bias", "swiglu_alpha", "swiglu_limit")
