"""ChunkedAotiStep: a layer-chunked engine's step (runtime/step/layer_chunks.py says why chunked).

The embedding runs eagerly, then one AOTInductor container per layer chunk in layer order (each
bound to its own layers' weights and given its own layers' KV pools), then the head's container.
A container call alone takes 14-19 us (bench/layer_chunks_experiment.py --run-cost, AVX2 EPYC), yet
a chunked step decodes one row 2-6% slower than the unrolled one over the same weights, whatever
the number of chunks (bench/README, stop 57): a 1B's four 4-layer chunks each took 6.02 ms but the
first after the embedding 6.29 ms, and the embedding 0.16 ms on its first call, 0.03 ms on a second,
so most of it is warm-up at the start of a step that the unrolled graph seems to pay less of. That
is why builder/layer_chunk_plan.py chunks only deep models under `auto`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from ifb.runtime.engine_format import EngineConfig, LayerChunk
from ifb.runtime.step.aoti_step import AotiStep
from ifb.runtime.step.layer_chunks import network_constant_name
from ifb.runtime.step.step_inputs import StepInputs

logger = logging.getLogger(__name__)

# glibc's mallopt parameters
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Each container run allocates its intermediates afresh. glibc serves blocks over its (dynamic)
# mmap threshold with a fresh mmap and unmaps them on free, so every run of a chunk page-faulted its
# buffers in again: a 512-token prefill of SmolLM2 in 5 chunks took 1.142x the unrolled step's,
# and 0.962x with these two thresholds (bench/README, stop 55). What stays mapped is bounded by
# the step's own peak of intermediates, which it needs again at the next step of that size.
_MMAP_THRESHOLD_BYTES = 256 * 2**20
_TRIM_THRESHOLD_BYTES = 2**30


def keep_step_buffers_mapped() -> bool:
    """Set glibc's thresholds for this process (above); False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)
    )


class ChunkedAotiStep:
    """The CPU backend's StepBackend for an engine with `layer_chunks`."""

    device = torch.device("cpu")

    def __init__(
        self,
        config: EngineConfig,
        constants: dict[str, torch.Tensor],
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """`constants`: the network's tensors by name (runtime/step/backend.py's step_constants);
        `embed_tokens`: token ids -> the hidden states the first chunk takes."""
        if not keep_step_buffers_mapped():
            logger.warning("could not set malloc thresholds: a chunked step may page-fault its buffers every run")
        self._embed_tokens = embed_tokens
        self._chunks = [
            (
                self._load_chunk(path, chunk, constants),
                2 * chunk.first_layer,
                2 * (chunk.first_layer + chunk.num_layers),
            )
            for path, chunk in zip(config.layer_chunk_paths, config.layer_chunks, strict=True)
        ]
        self._head = AotiStep(config.step_package_path, constants)

    @staticmethod
    def _load_chunk(path: Path, chunk: LayerChunk, constants: dict[str, torch.Tensor]) -> AotiStep:
        return AotiStep(path, constants, partial(network_constant_name, first=chunk.first_layer))

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        args = inputs.as_args()
        with torch.no_grad():  # the mapped weights are parameters: no autograd record of the lookup
            x = self._embed_tokens(args[0])
        per_step = args[1:-1]  # all but the token ids and the logits rows
        for chunk, first_pool, end_pool in self._chunks:
            (x,) = chunk.run([x, *per_step, *kv_pools[first_pool:end_pool]])
        (logits,) = self._head.run([x, args[-1]])
        return logits
