"""TensorRTStep: runs a TensorRT step plan on the GPU over the engine's device-resident KV pool.

Per step only the small index tensors go host -> device; the pool stays on the GPU, bound by
address. The plan returns this step's K/V rows (ONNX has no in-place writes, see
builder/export_onnx.py), which are scattered into the pool on the same stream. Logits come back
to the host for the sampler: [num_logits, vocab] float32, the one copy a step needs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ifb.runtime.engine_format import STEP_INPUT_NAMES, EngineConfig, TensorRTPlanInfo, kv_pool_names
from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.gpu import this_gpu
from ifb.runtime.step.step_inputs import StepInputs

logger = logging.getLogger(__name__)

DEVICE = torch.device("cuda")


def plan_mismatch(recorded: TensorRTPlanInfo | None, current: TensorRTPlanInfo) -> str | None:
    """Why a plan built for `recorded` cannot run here (`current`), or None. Plans are specific
    to the TensorRT version and the GPU model they were built on."""
    for key, what in (
        ("version", "TensorRT version"),
        ("gpu_name", "GPU"),
        ("compute_capability", "compute capability"),
    ):
        built_for = None if recorded is None else getattr(recorded, key)
        if built_for != getattr(current, key):
            return f"built for {what} {built_for!r}, this machine has {getattr(current, key)!r}"
    return None


def rebuild_hint(config: EngineConfig) -> str:
    return f"rebuild it here: {config.rebuild_command()}"


def _torch_dtype(trt: Any, dtype: Any) -> torch.dtype:
    table = {
        trt.float32: torch.float32,
        trt.float16: torch.float16,
        trt.bfloat16: torch.bfloat16,
        trt.int32: torch.int32,
        trt.int64: torch.int64,
    }
    return table[dtype]


class TensorRTStep:
    """The TensorRT backend's StepBackend; the KV pools live on the GPU."""

    device = DEVICE

    def __init__(self, config: EngineConfig) -> None:
        import tensorrt as trt

        problem = plan_mismatch(config.tensorrt, this_gpu())
        if problem is not None:
            raise EngineFormatError(f"{config.folder}: TensorRT plan {problem}; {rebuild_hint(config)}")
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._engine = self._runtime.deserialize_cuda_engine(config.step_package_path.read_bytes())
        if self._engine is None:
            raise EngineFormatError(f"{config.folder}: TensorRT could not load the plan; {rebuild_hint(config)}")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        num_pools = 2 * config.spec.num_layers
        # Bound by name in the step contract's order (the plan's own I/O order is not promised).
        self._inputs = [*STEP_INPUT_NAMES, *kv_pool_names(config.spec.num_layers)]
        self._outputs = ["logits", *(f"kv_rows_{i}" for i in range(num_pools))]
        if sorted(names) != sorted(self._inputs + self._outputs):
            raise EngineFormatError(f"{config.folder}: the plan's tensors {names} are not the step contract's")
        self._dtypes = {n: _torch_dtype(trt, self._engine.get_tensor_dtype(n)) for n in names}
        self._output_buffers = self._allocate_outputs(config)
        for name, buffer in self._output_buffers.items():  # fixed addresses: bound once
            self._context.set_tensor_address(name, buffer.data_ptr())
        self._empty = torch.zeros(1, dtype=torch.int64, device=DEVICE)  # an address for 0-row inputs

    def _allocate_outputs(self, config: EngineConfig) -> dict[str, torch.Tensor]:
        """Output buffers at their largest shape, allocated once; each step uses a prefix."""
        limits, spec = config.limits, config.spec
        largest = {"logits": (limits.max_batch_size, spec.vocab_size)}
        row_shape = (limits.max_num_tokens, spec.num_kv_heads, spec.head_dim)
        return {
            name: torch.empty(largest.get(name, row_shape), dtype=self._dtypes[name], device=DEVICE)
            for name in self._outputs
        }

    def _bind(self, name: str, tensor: torch.Tensor) -> None:
        # False (not an exception) when the shape is outside the plan's profile: execute would fail
        # later with a less specific message.
        if not self._context.set_input_shape(name, tuple(tensor.shape)):
            raise RuntimeError(f"TensorRT rejected {name} of shape {tuple(tensor.shape)}: outside the plan's profile")
        self._context.set_tensor_address(name, tensor.data_ptr() if tensor.numel() else self._empty.data_ptr())

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        # The pools are also written on the caller's stream (allocation, block copies): order the
        # plan after that work. Our own stream is idle on return (`.cpu()` below waits for it).
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            device_inputs = [
                t.to(DEVICE, dtype=self._dtypes[name], non_blocking=True)
                for name, t in zip(STEP_INPUT_NAMES, inputs.as_args(), strict=True)
            ]
            for name, tensor in zip(self._inputs, [*device_inputs, *kv_pools], strict=True):
                self._bind(name, tensor)
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            num_tokens, num_logits = device_inputs[0].shape[0], device_inputs[-1].shape[0]
            slot_mapping = device_inputs[2].long()
            for pool, name in zip(kv_pools, self._outputs[1:], strict=True):
                pool.index_copy_(0, slot_mapping, self._output_buffers[name][:num_tokens])
            logits = self._output_buffers["logits"][:num_logits].float().cpu()  # waits for the stream
        return logits
