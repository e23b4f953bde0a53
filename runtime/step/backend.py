"""StepBackend: what runs one step, and the one factory that picks it (compiled CPU, TensorRT,
or our network run eagerly as the reference the compiled ones are checked against)."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Protocol

import torch

from ifb.runtime.engine_format import BackendKind, EngineConfig
from ifb.runtime.engine_format.weights_file import map_weights
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.kernels import load_engine_kernels, step_load_error
from ifb.runtime.step.network import StepNetwork, attention_ops, rope_constants
from ifb.runtime.step.step_inputs import StepInputs


class StepBackend(Protocol):
    """(StepInputs, kv_pools) -> float32 logits [num_logits, vocab]; K/V of every input token are
    in the pools afterwards. `device` is where the pools must live."""

    device: torch.device

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor: ...


class StepMode(str, Enum):
    """How the step runs: the compiled artifact (the product), or eager paths for checking it."""

    COMPILED = "compiled"
    EAGER = "eager"  # our network, fast attention ops, not compiled
    REFERENCE = "reference"  # our network, per-request reference attention loops


def load_network(config: EngineConfig, reference_ops: bool) -> StepNetwork:
    state = map_weights(config.weights_path)
    inv_freq = state.pop("rope.inv_freq")
    with torch.device("meta"):  # the stored tensors are assigned, not copied into fresh modules
        network = StepNetwork(
            config.spec,
            inv_freq,
            config.rope_scaling,
            config.limits.max_seq_len,
            config.limits.block_size,
            ops=attention_ops(config.spec, reference=reference_ops, has_kernel_library=config.kernels is not None),
            weight_formats=config.weight_formats,
            weight_compute=config.weight_compute,
        )
    network.set_rope(inv_freq, config.rope_scaling, config.limits.max_seq_len)
    try:
        network.load_weights(state)
    except ValueError as error:
        raise EngineFormatError(f"{config.folder}: {error}") from error
    return network.to(getattr(torch, config.dtype)).eval()


class NetworkStep:
    """Our network, run eagerly on the CPU."""

    device = torch.device("cpu")

    def __init__(self, network: StepNetwork) -> None:
        self.network = network

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        return self.network(*inputs.as_args(), kv_pools)


def _cpu_step(config: EngineConfig) -> StepBackend:
    from ifb.runtime.step.aoti_step import AotiStep
    from ifb.runtime.step.chunked_step import ChunkedAotiStep

    constants = step_constants(config) if config.step_constants_external else None
    try:
        if config.layer_chunks:
            if constants is None:
                raise EngineFormatError(f"{config.folder}: layer_chunks need a step without its weights")
            embed_tokens = load_network(config, reference_ops=False).embed_tokens  # its tensors are mapped
            return ChunkedAotiStep(config, constants, embed_tokens)
        return AotiStep(config.step_package_path, constants)
    except OSError as error:
        raise step_load_error(config, error) from error


def step_constants(config: EngineConfig) -> dict[str, torch.Tensor]:
    """What a package compiled without its weights needs: the mapped weights file (no copy) and
    the rotary tables the network computes from its inv_freq, in float32 as the builder exported
    them (builder/network_recipe.py keeps set_rope's tables; the network rounds the rows it reads
    to the activations' dtype). Tables cast to a 16-bit engine's dtype were read as float32 by the
    compiled step: a bf16 mixture of experts (the first 16-bit engine with external constants) put
    wrong keys in its KV cache, its logits 2-5 x std off its eager network from the second token."""
    constants = map_weights(config.weights_path)
    inv_freq = constants.pop("rope.inv_freq")
    return {**constants, **rope_constants(config.spec, inv_freq, config.rope_scaling, config.limits.max_seq_len)}


def _tensorrt_step(config: EngineConfig) -> StepBackend:
    from ifb.runtime.step.gpu import tensorrt_unavailable_reason

    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise EngineFormatError(f"{config.folder} is a tensorrt engine: {reason}")
    from ifb.runtime.step.tensorrt_step import TensorRTStep  # imports tensorrt: GPU hosts only

    return TensorRTStep(config)


_COMPILED: dict[BackendKind, Callable[[EngineConfig], StepBackend]] = {
    BackendKind.CPU: _cpu_step,
    BackendKind.TENSORRT: _tensorrt_step,
}


def make_step_backend(config: EngineConfig, mode: StepMode = StepMode.COMPILED) -> StepBackend:
    """The one place the backend and mode are branched on."""
    load_engine_kernels(config)  # before the compiled library is dlopen'ed (it links the shim)
    if mode is not StepMode.COMPILED:
        return NetworkStep(load_network(config, reference_ops=mode is StepMode.REFERENCE))
    return _COMPILED[config.backend](config)
