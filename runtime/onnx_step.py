"""OnnxStep: runs the exported step graph with onnxruntime and writes the returned K/V rows into
the runtime's pools, so it has the same interface as the compiled step (checks the ONNX graph
the TensorRT backend is built from, on any CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class OnnxStep:
    def __init__(self, path: Path) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *args: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        *step_inputs, kv_pools = args
        assert isinstance(kv_pools, list)
        values = [t.numpy() for t in step_inputs if isinstance(t, torch.Tensor)] + [p.numpy() for p in kv_pools]
        outputs = self.session.run(None, dict(zip(self.input_names, values, strict=True)))
        slot_mapping = step_inputs[2]
        assert isinstance(slot_mapping, torch.Tensor)
        for pool, rows in zip(kv_pools, outputs[1:], strict=True):
            pool.index_copy_(0, slot_mapping, torch.from_numpy(np.ascontiguousarray(rows)))
        return torch.from_numpy(outputs[0])
