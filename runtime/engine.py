"""Engine: a loaded engine folder that runs one step per call over the KV pool it owns."""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import torch
from safetensors.torch import load_file

from ifb.builder.compile_cpu import kv_pool_views
from ifb.builder.compile_tensorrt import tensorrt_unavailable_reason
from ifb.builder.limits import kv_pool_shape
from ifb.builder.network import FAST_OPS, REFERENCE_OPS, StepNetwork
from ifb.runtime.aoti_step import AotiStep
from ifb.runtime.engine_config import EngineConfig, load_engine_config
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step_inputs import StepInputs

logger = logging.getLogger(__name__)

StepFn = Callable[..., torch.Tensor]


class StepMode(str, Enum):
    """How the step runs: the compiled artifact (the product), or eager paths for checking it."""

    COMPILED = "compiled"
    EAGER = "eager"  # our network, fast attention ops, not compiled
    REFERENCE = "reference"  # our network, per-request reference attention loops


def load_network(config: EngineConfig, reference_ops: bool) -> StepNetwork:
    state = load_file(str(config.weights))
    inv_freq = state.pop("rope.inv_freq")
    network = StepNetwork(
        config.spec,
        inv_freq,
        config.rope_scaling,
        config.limits.max_seq_len,
        config.limits.block_size,
        ops=REFERENCE_OPS if reference_ops else FAST_OPS,
    )
    network = network.to(getattr(torch, config.dtype))
    network.load_state_dict(state, strict=not config.spec.tie_word_embeddings)
    return network.eval()


def _load_tensorrt_step(config: EngineConfig) -> StepFn:
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise EngineFormatError(f"{config.folder} is a tensorrt engine: {reason}")
    from ifb.runtime.tensorrt_step import TensorRTStep  # imports tensorrt: GPU hosts only

    return TensorRTStep(config)


def _make_step(config: EngineConfig, mode: StepMode) -> StepFn:
    """The one place the backend and mode are branched on. Eager modes run our network on the CPU."""
    if mode is not StepMode.COMPILED:
        return load_network(config, reference_ops=mode is StepMode.REFERENCE)
    loaders: dict[str, Callable[[EngineConfig], StepFn]] = {
        "cpu": lambda c: AotiStep(c.step_package),
        "tensorrt": _load_tensorrt_step,
    }
    if config.backend not in loaders:
        raise EngineFormatError(f"{config.folder}: unknown backend {config.backend!r} (known: {', '.join(loaders)})")
    return loaders[config.backend](config)


class Engine:
    """Owns the KV pool; `step` runs one packed batch and returns float32 logits [R, vocab]."""

    def __init__(self, config: EngineConfig, mode: StepMode = StepMode.COMPILED) -> None:
        self.config = config
        self.mode = mode
        self._step = _make_step(config, mode)
        device = getattr(self._step, "device", torch.device("cpu"))  # TensorRTStep: the GPU
        shape = kv_pool_shape(config.spec, config.limits)
        self.kv_cache = torch.zeros(shape, dtype=getattr(torch, config.dtype), device=device)
        self.kv_pools = kv_pool_views(self.kv_cache)

    @classmethod
    def load(cls, folder: str | Path, mode: StepMode = StepMode.COMPILED, verify: bool = True) -> Engine:
        return cls(load_engine_config(folder, verify=verify), mode)

    def step(self, inputs: StepInputs) -> torch.Tensor:
        with torch.inference_mode():
            return self._step(*inputs.as_args(), self.kv_pools)
