"""Which layer chunks a block engine's step compiles as (runtime/step/layer_chunks.py says why).

Layers are alike when one compiled graph serves them: the same modules, weight formats, tensor
shapes and dtypes, attention variant and RoPE (`layer_signature`). A file's layers are often not
all alike: llama.cpp's Q4_K_M keeps attn_v and ffn_down in Q6_K in the first and last eighth and
every third layer between, so the plan looks for runs of K layers that repeat (starting at an
offset), and compiles one package per distinct run, plus the head's.

The choice is by an estimate of the compile phase, from SmolLM2 builds on the 2-core AVX2 EPYC
(stop 56): a chunk package of 5 layers took 16.6 s and one of 10 layers 20.7 s (export and
compile), so ~12 s is fixed and a layer adds ~0.8 s; the head's package (13 nodes) ~6 s; the
unrolled step of 30 layers 41 s. Each chunk is one more container run a step, and a run costs
more than its ctypes call (bench/step_ab.py, SmolLM2, steps interleaved: 6 chunks made decode b8
1.054x the unrolled step's, 3 chunks 1.035x, decode b1 1.041x and 1.015x), so the runs are capped
by the layers' bytes, which a decode step's time follows.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from ifb.runtime.step.network import DecoderLayer, StepNetwork

PACKAGE_SECONDS = 12.0
HEAD_SECONDS = 6.0
LAYER_SECONDS = 0.8
# Chunking must save at least this share of the unrolled compile estimate: each chunk costs a step
# a container run, which a small saving does not pay for.
MIN_SAVING = 0.2
# Container runs a step may have. A run cost a decode step ~0.1 ms more than its layers' share of
# the unrolled step (the same weights file, steps interleaved: SmolLM2 in 3 chunks, decode b1 5.84
# -> 6.22 ms; a 1B-width Q4_0 in 8 chunks, 25.8 -> 26.9 ms, b8 1.013x, prefill 512 1.004x), and a
# decode step takes about its bytes' reading time (~27 GB/s here), so a run per 128 MiB of layers
# keeps decode b1 within ~2.5%: SmolLM2 (~70 MB) is not chunked, a 1B's 16 layers (~550 MB) may
# run 4 chunks, deeper models up to MAX_RUNS.
MAX_RUNS = 8
BYTES_PER_RUN = 128 * 2**20


class LayerChunking(str, Enum):
    """`ifb build --layer-chunks`: auto = where the plan saves compile time within the run cap;
    on = wherever the layers repeat (up to MAX_RUNS chunks); off = always the unrolled step."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    """The chunks in layer order as (first layer, number of layers), and each one's package index:
    chunks of alike layers share one."""

    chunks: tuple[tuple[int, int], ...]
    packages: tuple[int, ...]

    @property
    def num_packages(self) -> int:
        return len(set(self.packages))


def layer_signature(network: StepNetwork, index: int) -> Hashable:
    """What a compiled graph of layer `index` depends on: its module tree, its tensors' names
    (relative to the layer), shapes and dtypes, its weights' block formats, and the per-layer
    choices of its attention (window, soft cap, RoPE or not, local RoPE tables)."""
    layer = network.layers[index]
    assert isinstance(layer, DecoderLayer)
    prefix = f"layers.{index}."
    tensors = tuple((name, tuple(t.shape), t.dtype) for name, t in _tensors(layer))
    formats = tuple(
        sorted(
            (name[len(prefix) :], fmt.value) for name, fmt in network.weight_formats.items() if name.startswith(prefix)
        )
    )
    attention = (layer.local_rope, layer.attn.rotary, layer.attn.variant, layer.attn.sinks is not None)
    return (repr(layer), tensors, formats, attention)


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def plan_layer_chunks(
    signatures: Sequence[Hashable], layer_bytes: int, chunking: LayerChunking = LayerChunking.AUTO
) -> ChunkPlan | None:
    """The cheapest chunking to compile that saves MIN_SAVING of the unrolled estimate within the
    run cap (with `on`: any, within MAX_RUNS), or None (compile the step unrolled)."""
    num_layers = len(signatures)
    if chunking is LayerChunking.OFF:
        return None
    forced = chunking is LayerChunking.ON
    max_runs = MAX_RUNS if forced else min(MAX_RUNS, layer_bytes // BYTES_PER_RUN)
    unrolled = math.inf if forced else unrolled_seconds(num_layers)
    best: tuple[float, int, ChunkPlan] | None = None
    for size in range(1, num_layers):
        for offset in range(size):
            chunks = _chunks(num_layers, size, offset)
            if not 2 <= len(chunks) <= max_runs:
                continue
            plan = _plan(chunks, signatures)
            seconds = estimated_seconds(plan)
            candidate = (seconds, len(chunks), plan)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is None or best[0] > (1 - MIN_SAVING) * unrolled:
        return None
    return best[2]


def estimated_seconds(plan: ChunkPlan) -> float:
    """The compile phase's estimate for `plan`: each distinct package and the head's."""
    layers = {package: count for (_, count), package in zip(plan.chunks, plan.packages, strict=True)}
    return PACKAGE_SECONDS * len(layers) + LAYER_SECONDS * sum(layers.values()) + HEAD_SECONDS


def unrolled_seconds(num_layers: int) -> float:
    """The compile phase's estimate for the unrolled step of `num_layers`."""
    return PACKAGE_SECONDS + LAYER_SECONDS * num_layers


def _chunks(num_layers: int, size: int, offset: int) -> list[tuple[int, int]]:
    """[0, offset) if offset, then runs of `size` (the last one shorter where it must be)."""
    starts = ([0] if offset else []) + list(range(offset, num_layers, size))
    ends = [*starts[1:], num_layers]
    return [(start, end - start) for start, end in zip(starts, ends, strict=True)]


def _plan(chunks: list[tuple[int, int]], signatures: Sequence[Hashable]) -> ChunkPlan:
    index: dict[tuple[Hashable, ...], int] = {}
    packages = [index.setdefault(tuple(signatures[first : first + count]), len(index)) for first, count in chunks]
    return ChunkPlan(tuple(chunks), tuple(packages))


def plan_for(network: StepNetwork, chunking: LayerChunking) -> ChunkPlan | None:
    """The plan for `network` (None: unrolled)."""
    signatures = [layer_signature(network, index) for index in range(len(network.layers))]
    layer_bytes = sum(t.numel() * t.element_size() for layer in network.layers for _, t in _tensors(layer))
    return plan_layer_chunks(signatures, layer_bytes, chunking)
