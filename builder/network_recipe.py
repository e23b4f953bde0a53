"""NetworkRecipe: everything that makes the step network except its weights.

It is small and picklable, so the step can be compiled in a process of its own
(builder/compile_process.py) that maps the engine's weights file itself rather than receiving a
copy of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ifb.plugins.quant_formats import WeightCompute, WeightFormat
from ifb.runtime.engine_format import ModelSpec
from ifb.runtime.engine_format.weights_file import map_weights
from ifb.runtime.step.network import StepNetwork, attention_ops

INV_FREQ = "rope.inv_freq"  # stored beside the network's state: the runtime rebuilds the rotary tables


@dataclass(frozen=True)
class NetworkRecipe:
    spec: ModelSpec
    inv_freq: torch.Tensor
    rope_scaling: float
    max_seq_len: int
    block_size: int
    weight_formats: dict[str, WeightFormat]  # StepNetwork.weight_formats: empty for a dense network
    weight_compute: WeightCompute

    def empty_network(self) -> StepNetwork:
        """The network on the meta device: no allocation of the modules that will hold blocks."""
        with torch.device("meta"):
            network = StepNetwork(
                self.spec,
                self.inv_freq,
                self.rope_scaling,
                self.max_seq_len,
                self.block_size,
                # block weights bring the engine's kernel library (builder/backends.py), decode attention with it
                ops=attention_ops(self.spec, reference=False, has_kernel_library=bool(self.weight_formats)),
                weight_formats=self.weight_formats,
                weight_compute=self.weight_compute,
            )
        network.set_rope(self.inv_freq, self.rope_scaling, self.max_seq_len)
        return network

    def load(self, weights_path: Path) -> StepNetwork:
        """The network over the mapped weights file; ValueError if the file does not match it."""
        network = self.empty_network()
        state = map_weights(weights_path)
        state.pop(INV_FREQ)
        network.load_weights(state)
        return network.eval()
