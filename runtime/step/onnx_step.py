"""OnnxStep: runs the exported step graph with onnxruntime and writes the returned K/V rows into
the runtime's pools, so it has the same interface as the compiled step (checks the ONNX graph
the TensorRT backend is built from, on any CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ifb.runtime.step.step_inputs import StepInputs


class OnnxStep:
    """A StepBackend over an exported ONNX step graph (onnxruntime, CPU)."""

    device = torch.device("cpu")

    def __init__(self, path: Path) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        values = [t.numpy() for t in inputs.as_args()] + [p.numpy() for p in kv_pools]
        outputs = self.session.run(None, dict(zip(self.input_names, values, strict=True)))
        slot_mapping = inputs.slot_mapping
        for pool, rows in zip(kv_pools, outputs[1:], strict=True):
            pool.index_copy_(0, slot_mapping, torch.from_numpy(np.ascontiguousarray(rows)))
        return torch.from_numpy(outputs[0])
