"""ifb_quant.quant_embedding inside an AOTInductor package: a tied Q6_K embedding and LM head.

Pins what a compiled step with a tied block-quantized table relies on: the graph calls the
library's `aoti_torch_cpu_quant_embedding` shim (no proxy executor), the one packed table is a
single uint8 constant read by both the gather and the head's matmul, and the package's output
equals eager bit for bit for several token counts of one dynamic dimension.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from quant_cases import random_blocks

from ifb.plugins import quant_ops
from ifb.plugins.quant_build import QuantLibrary
from ifb.plugins.quant_formats import WeightCompute, WeightFormat

VOCAB, HIDDEN, FMT = 40, 256, WeightFormat.Q6_K


class _TiedToy(torch.nn.Module):
    """ids -> embedding rows -> logits through the same packed int8-layout tiles."""

    def __init__(self) -> None:
        super().__init__()
        blocks = random_blocks(VOCAB, HIDDEN, FMT, seed=0)
        self.register_buffer("table", quant_ops.pack_int8(blocks, FMT, VOCAB, HIDDEN))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = quant_ops.quant_embedding(ids, self.table, FMT, WeightCompute.INT8, VOCAB, HIDDEN)
        # clamp, not tanh: exact in both, where Inductor's vectorized tanh is 1 ulp off eager's on
        # some CPUs (AVX-512 + AMX Xeon: max 6e-8), which this test is not about
        return quant_ops.quant_linear_int8(h.clamp(-1.0, 1.0), self.table, FMT, VOCAB, HIDDEN)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory, quant_library: QuantLibrary) -> tuple[Path, _TiedToy]:
    model = _TiedToy().eval()
    tokens = torch.export.Dim("tokens", min=1, max=64)
    exported = torch.export.export(model, (torch.tensor([1, 2, 3]),), dynamic_shapes=({0: tokens},))
    out = tmp_path_factory.mktemp("quant-embedding-aoti")
    configs = {"freezing": True, **quant_ops.aoti_configs()}
    path = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(out / "model.pt2"), inductor_configs=configs
    )
    with zipfile.ZipFile(path) as archive:
        archive.extractall(out / "unpacked")
    return Path(path), model


def _wrapper_source(package_path: Path) -> str:
    (found,) = [p for p in (package_path.parent / "unpacked").rglob("*.wrapper.cpp") if "/aotinductor/" in str(p)]
    return found.read_text()


def test_compiled_graph_calls_the_embedding_shim_on_one_table(package: tuple[Path, _TiedToy]) -> None:
    """The gather goes through its C shim, and the tied table is one uint8 constant."""
    source = _wrapper_source(package[0])
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_quant_embedding(") == 1
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_quant_matmul_int8(") == 1
    assert "proxy_executor_call_function" not in source
    assert source.count(".dtype = cached_torch_dtype_uint8;") == 1


@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_package_equals_eager_bitwise(package: tuple[Path, _TiedToy], tokens: int) -> None:
    path, model = package
    compiled = torch._inductor.aoti_load_package(str(path))
    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(tokens))
    assert torch.equal(compiled(ids), model(ids))
