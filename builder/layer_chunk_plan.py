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

Where a machine has a second core, a second process compiles some of the packages beside the
first (builder/package_helper.py): the estimate of a plan is then its makespan over the two.
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
# A layer of an unrolled step costs more than one of a chunk: 30 of SmolLM2's took 42.1 s, 16 and 48
# of a 1B's width 31.8 and 71.5 s (bench/compile_ab.py, stop 56): 1.0 and 1.24 s a layer past the
# fixed 12 s.
UNROLLED_LAYER_SECONDS = 1.1
# Chunking must save at least this share of the unrolled compile estimate. Chunked steps decode at
# batch 1 some 2-6% slower than unrolled ones over the same weights file whatever their number of
# chunks (bench/README, stop 57: a 1B-width Q4_0 of 16 layers in 4 chunks 1.021-1.047x, 8 chunks
# 1.042x at stop 56; 48 layers of Q4_K_M in 8 chunks 1.042x; SmolLM2 in 3 chunks 1.060x; batch 8
# and up within 2%, prefill within 1%), so only deep models, whose compile chunks cut by a third or
# more, chunk under `auto`: 48 layers of a 1B's width (Q4_0 and Q4_K_M), not its 16, nor 32 of an 8B's.
MIN_SAVING = 0.35
# Container runs a step may have. A run cost a decode step ~0.1 ms more than its layers' share of
# the unrolled step (the same weights file, steps interleaved: SmolLM2 in 3 chunks, decode b1 5.84
# -> 6.22 ms; a 1B-width Q4_0 in 8 chunks, 25.8 -> 26.9 ms, b8 1.013x, prefill 512 1.004x), and a
# decode step takes about its bytes' reading time (~27 GB/s here), so a run per 128 MiB of layers
# keeps that part of decode b1 within ~2.5%: SmolLM2 (~70 MB) is not chunked, deeper models up to
# MAX_RUNS.
MAX_RUNS = 8
BYTES_PER_RUN = 128 * 2**20
# A helper process's spawn, imports (torch's compiler stack) and mapping of the network before its
# first package: 3.9-4.0 s of imports on the quiet 2-core EPYC (compile_process.py), ~1 s to map.
HELPER_START_SECONDS = 5.0
# Two package compiles at once on 2 cores: each took 1.34x and 1.46x its time alone (SmolLM2's
# chunk packages, 26.6 s alone; 35.6 and 38.9 s together: 1.4x the throughput, stop 56).
TOGETHER_SLOWDOWN = 1.46


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
    signatures: Sequence[Hashable],
    layer_bytes: int,
    chunking: LayerChunking = LayerChunking.AUTO,
    workers: int = 1,
) -> ChunkPlan | None:
    """The cheapest chunking to compile that saves MIN_SAVING of the unrolled estimate within the
    run cap (with `on`: any, within MAX_RUNS), or None (compile the step unrolled). `workers`: the
    processes that may compile packages at once (1 or 2)."""
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
            seconds = estimated_seconds(plan, workers)
            candidate = (seconds, len(chunks), plan)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
    if best is None or best[0] > (1 - MIN_SAVING) * unrolled:
        return None
    return best[2]


def estimated_seconds(plan: ChunkPlan, workers: int = 1) -> float:
    """The compile phase's estimate for `plan`: each distinct package and the head's, in this
    process alone or, with `workers` 2, split with a helper (`split_packages`) where that is faster."""
    seconds = package_seconds(plan)
    local, helper = split_packages(seconds, workers)
    return _makespan([seconds[i] for i in local], [seconds[i] for i in helper])


def package_seconds(plan: ChunkPlan) -> list[float]:
    """Each package's compile estimate: the distinct chunks' in package order, then the head's."""
    layers = {package: count for (_, count), package in zip(plan.chunks, plan.packages, strict=True)}
    return [PACKAGE_SECONDS + LAYER_SECONDS * layers[package] for package in sorted(layers)] + [HEAD_SECONDS]


def split_packages(seconds: Sequence[float], workers: int) -> tuple[list[int], list[int]]:
    """Which packages (indices into `seconds`) this process compiles and which a helper process
    compiles beside it: longest first, each to the process estimated to finish it first (the
    helper starting HELPER_START_SECONDS late); no helper where that is not estimated faster."""
    alone = list(range(len(seconds)))
    if workers < 2 or len(seconds) < 2:
        return alone, []
    local: list[int] = []
    helper: list[int] = []
    for index in sorted(alone, key=lambda i: -seconds[i]):
        local_end = sum(seconds[i] for i in local) + seconds[index]
        helper_end = HELPER_START_SECONDS + sum(seconds[i] for i in helper) + seconds[index]
        (local if local_end <= helper_end else helper).append(index)
    split = (sorted(local), sorted(helper))
    times = [seconds[i] for i in split[0]], [seconds[i] for i in split[1]]
    if not split[1] or _makespan(*times) >= sum(seconds):
        return alone, []
    return split


def _makespan(local: Sequence[float], helper: Sequence[float]) -> float:
    """While both processes run (the helper's start included: its imports take a core) each goes
    TOGETHER_SLOWDOWN slower; the longer one's rest alone."""
    if not helper:
        return sum(local)
    mine, theirs = sum(local), HELPER_START_SECONDS + sum(helper)
    return max(mine, theirs) + (TOGETHER_SLOWDOWN - 1) * min(mine, theirs)


def unrolled_seconds(num_layers: int) -> float:
    """The compile phase's estimate for the unrolled step of `num_layers`."""
    return PACKAGE_SECONDS + UNROLLED_LAYER_SECONDS * num_layers


def _chunks(num_layers: int, size: int, offset: int) -> list[tuple[int, int]]:
    """[0, offset) if offset, then runs of `size` (the last one shorter where it must be)."""
    starts = ([0] if offset else []) + list(range(offset, num_layers, size))
    ends = [*starts[1:], num_layers]
    return [(start, end - start) for start, end in zip(starts, ends, strict=True)]


def _plan(chunks: list[tuple[int, int]], signatures: Sequence[Hashable]) -> ChunkPlan:
    index: dict[tuple[Hashable, ...], int] = {}
    packages = [index.setdefault(tuple(signatures[first : first + count]), len(index)) for first, count in chunks]
    return ChunkPlan(tuple(chunks), tuple(packages))


def plan_for(network: StepNetwork, chunking: LayerChunking, workers: int) -> ChunkPlan | None:
    """The plan for `network` (None: unrolled)."""
    signatures = [layer_signature(network, index) for index in range(len(network.layers))]
    layer_bytes = sum(t.numel() * t.element_size() for layer in network.layers for _, t in _tensors(layer))
    return plan_layer_chunks(signatures, layer_bytes, chunking, workers)
