"""The build packs a fused module's GGUF parts (q/k/v, gate/up) as their concatenation.

Pins `weight_loader.network_state`'s hand-off to the packer: it passes the parts in the file's
order without concatenating them, and every fused module's packed tiles — as the build writes them
(`PackedTiles.write_into`, chunk by chunk) and in memory — are the weight-by-weight reference
packer's tiles of the concatenated rows, for both compute modes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import write_gguf, write_hf_checkpoint

from ifb.builder.hf_config import model_spec_from_hf_config
from ifb.builder.sources import load_metadata, open_tensors, resolve_source
from ifb.builder.weight_loader import PackedTiles, network_state, plan_weights
from ifb.plugins.quant_formats import WeightCompute
from ifb.plugins.quant_pack_reference import pack_reference
from ifb.runtime.engine_format.weights_file import TensorEntry, WeightsWriter, map_weights


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fused")
    write_hf_checkpoint(folder / "hf", "llama", seed=4)
    return write_gguf(folder / "tiny-q4_0.gguf", folder / "hf", linear_type="Q4_0")


@pytest.mark.parametrize("compute", list(WeightCompute), ids=lambda mode: mode.value)
def test_fused_parts_pack_as_the_concatenated_rows(q4_0_gguf: Path, compute: WeightCompute, tmp_path: Path) -> None:
    metadata = load_metadata(resolve_source(str(q4_0_gguf)))
    tensors = open_tensors(metadata.source, model_spec_from_hf_config(metadata.hf_config))
    plan = plan_weights(tensors, "auto")
    state = dict(network_state(tensors, plan, compute))
    fused = {module: names for module, names in tensors.linears.items() if len(names) > 1}
    assert fused, "the tiny llama has fused q/k/v and gate/up modules"
    for module, names in fused.items():
        fmt = plan.formats[module]
        rows = torch.cat([tensors.block_rows(name) for name in names])
        k = tensors.info(names[0]).cols
        expected = pack_reference(rows, fmt, rows.shape[0], k, int8_layout=compute is WeightCompute.INT8)
        packed = state[f"{module}.packed"]
        assert isinstance(packed, PackedTiles)
        assert torch.equal(packed.tensor(), expected), f"{module} ({', '.join(names)})"
        assert torch.equal(_written(packed, tmp_path / f"{module}.safetensors"), expected), module


def _written(packed: PackedTiles, path: Path) -> torch.Tensor:
    """The tiles as the build writes them into the weights file, mapped back."""
    tiles = packed.tensor()
    writer = WeightsWriter(path, {"tiles": TensorEntry(torch.uint8, tuple(tiles.shape))})
    packed.write_into(writer, "tiles")
    writer.close()
    return map_weights(path)["tiles"]
