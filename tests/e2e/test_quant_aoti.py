"""ifb_quant.quant_matmul and ifb_quant.paged_attention inside AOTInductor packages, run through
the runtime's ctypes path.

Pins what the builder and runtime rely on: with `quant_ops.aoti_configs()` the compiled graph
calls the library's C shim directly (no proxy executor, which the ctypes runtime does not pass),
freezing keeps the uint8 packed weights as constants fed to the op (nothing folded through it),
and the compiled output equals eager bit for bit for several batch sizes of one dynamic M. The
one attention op reaches its shim with the variant's fields as a string literal and the sinks as
an optional tensor (a constant, or nullptr for none), and gives eager's bits.
"""

from __future__ import annotations

import ctypes
import zipfile
from pathlib import Path

import pytest
import torch

from ifb.plugins import quant_ops
from ifb.plugins.attention_variant import AttentionVariant
from ifb.plugins.quant_build import QuantLibrary
from ifb.plugins.quant_formats import WeightFormat, quantize

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _ToyMlp(torch.nn.Module):
    """Two quantized linears (Q4_1 then Q8_0) around a SiLU, weights as frozen uint8 buffers."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shapes = ((inner, hidden, WeightFormat.Q4_1), (hidden, inner, WeightFormat.Q8_0))
        for index, (n, k, fmt) in enumerate(self.shapes):
            blocks = quantize(torch.randn(n, k) * 0.1, fmt)
            self.register_buffer(f"w{index}", quant_ops.pack(blocks, fmt, n, k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (n0, k0, f0), (n1, k1, f1) = self.shapes
        h = torch.nn.functional.silu(quant_ops.quant_linear(x, self.w0, f0, n0, k0))
        return quant_ops.quant_linear(h, self.w1, f1, n1, k1) + x


def _run_ctypes(library_path: Path, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The runtime/aoti_step.py calls: plain CDLL, Run with stream=None and proxy_executor=None."""
    lib = ctypes.CDLL(str(library_path))
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    lib.AOTInductorModelContainerRun.argtypes = [pointer, pointer, size, pointer, size, pointer, pointer]
    handle = ctypes.c_void_p()
    assert lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(handle), size(1), b"cpu", None) == 0
    try:
        handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)
        input_array = (ctypes.c_void_p * len(handles))(*[_capsule_pointer(h, None) for h in handles])
        output_array = (ctypes.c_void_p * 1)()
        code = lib.AOTInductorModelContainerRun(handle, input_array, len(handles), output_array, 1, None, None)
        assert code == 0, "AOTInductorModelContainerRun failed"
        (out,) = torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_new_capsule(p, None, None) for p in output_array]
        )
        return out
    finally:
        lib.AOTInductorModelContainerDelete(handle)


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory: pytest.TempPathFactory, quant_library: QuantLibrary) -> tuple[Path, _ToyMlp]:
    model = _ToyMlp(hidden=64, inner=96).eval()
    m = torch.export.Dim("m", min=1, max=64)
    exported = torch.export.export(model, (torch.randn(4, 64),), dynamic_shapes=({0: m},))
    return _compile_and_unpack(exported, tmp_path_factory.mktemp("quant-aoti")), model


def _compile_and_unpack(exported: torch.export.ExportedProgram, out: Path) -> Path:
    """AOTInductor with freezing and our ops' C shims, as the builder compiles; the package unzipped."""
    configs = {"freezing": True, **quant_ops.aoti_configs()}
    package = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(out / "model.pt2"), inductor_configs=configs
    )
    with zipfile.ZipFile(package) as archive:
        archive.extractall(out / "unpacked")
    return out / "unpacked"


def _one(folder: Path, suffix: str) -> Path:
    (found,) = [p for p in folder.rglob(f"*{suffix}") if "/aotinductor/" in str(p)]
    return found


def test_compiled_graph_calls_the_c_shim_not_the_proxy_executor(package_dir: tuple[Path, _ToyMlp]) -> None:
    """The generated wrapper calls aoti_torch_cpu_quant_matmul twice and never the proxy executor."""
    source = _one(package_dir[0], ".wrapper.cpp").read_text()
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_quant_matmul(") == 2
    assert "proxy_executor_call_function" not in source


def test_freezing_keeps_packed_weights_as_uint8_constants(package_dir: tuple[Path, _ToyMlp]) -> None:
    """Both packed buffers reach the op as uint8 constants: nothing is folded through the op."""
    source = _one(package_dir[0], ".wrapper.cpp").read_text()
    assert source.count(".dtype = cached_torch_dtype_uint8;") == 2
    assert ".from_folded = true" not in source
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_quant_matmul(") == 2


@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_ctypes_run_equals_eager_bitwise(package_dir: tuple[Path, _ToyMlp], rows: int) -> None:
    """The package run through ctypes (no proxy executor) gives eager's exact bits, any M."""
    folder, model = package_dir
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    compiled = _run_ctypes(_one(folder, ".so"), [x])
    assert torch.equal(compiled, model(x))


class _ToyAttention(torch.nn.Module):
    """The attention op twice: a gpt-oss-like layer (window, cap, sinks) and a plain one (no sinks)."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.register_buffer("sinks", torch.randn(heads, generator=torch.Generator().manual_seed(5)) * 2)
        self.fields = AttentionVariant(window=20, softcap=5.0).kernel_fields()

    def forward(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        attend = torch.ops.ifb_quant.paged_attention
        sunk = attend(q, k_pool, v_pool, tables, lengths, 16, 0.125, self.fields, self.sinks)
        return sunk + attend(q, k_pool, v_pool, tables, lengths, 16, 0.125, "", None)


def _attention_inputs(rows: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 9, 64, generator=generator)
    pools = [torch.randn(64 * 16, 3, 64, generator=generator) for _ in range(2)]
    tables = torch.stack([torch.randperm(64, generator=generator)[:4] for _ in range(rows)])
    lengths = torch.randint(1, 4 * 16 + 1, (rows,), generator=generator)
    return [q, *pools, tables, lengths]


@pytest.fixture(scope="module")
def attention_package(
    tmp_path_factory: pytest.TempPathFactory, quant_library: QuantLibrary
) -> tuple[Path, _ToyAttention]:
    model = _ToyAttention(heads=9).eval()
    rows = torch.export.Dim("rows", min=1, max=32)
    exported = torch.export.export(
        model, tuple(_attention_inputs(4, seed=0)), dynamic_shapes=({0: rows}, None, None, {0: rows}, {0: rows})
    )
    return _compile_and_unpack(exported, tmp_path_factory.mktemp("attention-aoti")), model


@pytest.mark.parametrize("rows", [1, 7])
def test_the_attention_contract_reaches_its_shim_and_gives_eagers_bits(
    attention_package: tuple[Path, _ToyAttention], rows: int
) -> None:
    folder, model = attention_package
    source = _one(folder, ".wrapper.cpp").read_text()
    assert source.count("AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_cpu_paged_attention(") == 2
    assert '"window=20;softcap=5.0"' in source and "proxy_executor_call_function" not in source
    inputs = _attention_inputs(rows, seed=rows)
    compiled = _run_ctypes(_one(folder, ".so"), inputs)
    assert torch.equal(compiled, model(*inputs))
