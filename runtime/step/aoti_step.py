"""AotiStep: runs a compiled step package through AOTInductor's C interface, without the GIL.

torch's own loader (`aoti_load_package`) keeps the GIL for the whole call, 40-130 ms per step
on this machine, so the server's event loop could only parse, tokenize and stream between
steps: a new request needed several step boundaries before it reached the scheduler
(bench/serving.py measured TTFT p50 1.9 s over HTTP vs 0.5 s in-process at 4 req/s). Calling the
package's model library through ctypes releases the GIL for the call; the library, its inputs
and outputs are the ones torch's loader would use (same container ABI, same tensor handles).
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
import weakref
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from ifb.runtime.errors import EngineFormatError
from ifb.runtime.step.step_inputs import StepInputs

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _extract_model_library(package: Path, into: Path) -> Path:
    with zipfile.ZipFile(package) as archive:
        libraries = [n for n in archive.namelist() if n.endswith(".so") and "/aotinductor/" in n]
        if len(libraries) != 1:
            raise EngineFormatError(f"{package}: expected one AOTInductor model library, found {libraries}")
        return Path(archive.extract(libraries[0], into))


# c10::ScalarType codes (what AOTInductorModelContainerGetConstantDtype returns) of the dtypes an
# engine's constants take; a code not listed is not checked.
_SCALAR_TYPES = {
    0: torch.uint8,
    1: torch.int8,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    15: torch.bfloat16,
}


class _ConstantEntry(ctypes.Structure):
    """AOTInductorConstantMapEntry: a C struct, so no std::unordered_map crosses into the library."""

    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


class _Container:
    """One AOTInductor model container over a dlopen'ed model library."""

    def __init__(self, library_path: Path) -> None:
        self.lib = ctypes.CDLL(str(library_path))  # CDLL (not PyDLL): calls release the GIL
        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        # (container, inputs, num_inputs, outputs, num_outputs, stream, proxy executor)
        self.lib.AOTInductorModelContainerRun.argtypes = [pointer, pointer, size, pointer, size, pointer, pointer]
        self.handle = ctypes.c_void_p()
        create = self.lib.AOTInductorModelContainerCreateWithDevice
        self._check(create(ctypes.byref(self.handle), ctypes.c_size_t(1), b"cpu", None), "create")
        self.num_inputs = self._count("AOTInductorModelContainerGetNumInputs")
        self.num_outputs = self._count("AOTInductorModelContainerGetNumOutputs")

    def _count(self, function: str) -> int:
        value = ctypes.c_size_t()
        self._check(getattr(self.lib, function)(self.handle, ctypes.byref(value)), function)
        return value.value

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:  # the library has printed the C++ exception to stderr
            raise RuntimeError(f"compiled step: AOTInductor {what} failed (code {code})")

    def _constant_text(self, function: str, index: int) -> str:
        value = ctypes.c_char_p()
        self._check(getattr(self.lib, function)(self.handle, ctypes.c_size_t(index), ctypes.byref(value)), function)
        return (value.value or b"").decode()

    def constant_dtype(self, index: int) -> int:
        """The c10 ScalarType code the library was compiled for its constant `index`."""
        value = ctypes.c_int32()
        function = "AOTInductorModelContainerGetConstantDtype"
        self._check(getattr(self.lib, function)(self.handle, ctypes.c_size_t(index), ctypes.byref(value)), function)
        return value.value

    def constant_names(self) -> dict[str, str]:
        """Each constant's name in the library -> the network's name for it (its original FQN)."""
        names: dict[str, str] = {}
        for index in range(self._count("AOTInductorModelContainerGetNumConstants")):
            name = self._constant_text("AOTInductorModelContainerGetConstantName", index)
            names[name] = self._constant_text("AOTInductorModelContainerGetConstantOriginalFQN", index)
        return names

    def use_constants(self, constants: dict[str, torch.Tensor]) -> None:
        """Point the library's constants at caller-owned tensors (no copy; they must outlive it)."""
        handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(constants.values()))
        self._constant_handles = handles  # the handles reference the tensors: keep them alive
        pairs = zip(constants, handles, strict=True)
        entries = [_ConstantEntry(name.encode(), _capsule_pointer(h, None)) for name, h in pairs]
        array = (_ConstantEntry * len(entries))(*entries)
        code = self.lib.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs(
            self.handle, array, ctypes.c_size_t(len(constants)), ctypes.c_bool(False), ctypes.c_bool(True)
        )
        self._check(code, "UpdateUserManagedConstantBufferPairs")

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        # New handles to the inputs, stolen (freed) by the container; outputs stolen back by torch.
        handles = torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(inputs)
        input_array = (ctypes.c_void_p * len(handles))(*[_capsule_pointer(h, None) for h in handles])
        output_array = (ctypes.c_void_p * self.num_outputs)()
        code = self.lib.AOTInductorModelContainerRun(
            self.handle, input_array, len(handles), output_array, self.num_outputs, None, None
        )
        self._check(code, "run")
        return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs(
            [_new_capsule(pointer, None, None) for pointer in output_array]
        )

    def close(self) -> None:
        if self.handle:
            self.lib.AOTInductorModelContainerDelete(self.handle)
            self.handle = ctypes.c_void_p()


class AotiStep:
    """The CPU backend's StepBackend: the compiled step, called without the GIL."""

    device = torch.device("cpu")

    def __init__(
        self,
        package: Path,
        constants: dict[str, torch.Tensor] | None = None,
        constant_name: Callable[[str], str] = str,
    ) -> None:
        """`constants`: the network's tensors by name, for a package compiled without its weights
        (the engine's weights file, mapped, is then the only copy of them); `constant_name` maps
        the name the package was compiled with to the network's (a layer chunk's, layer_chunks.py)."""
        scratch = Path(tempfile.mkdtemp(prefix="ifb-step-"))
        try:
            library = _extract_model_library(package, scratch)
            self._container = _Container(library)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # dlopen keeps its mapping; no file is left
        self._finalizer = weakref.finalize(self, self._container.close)
        if constants is not None:
            self._constants = self._bind(constants, constant_name)
            self._container.use_constants(self._constants)

    def _bind(self, constants: dict[str, torch.Tensor], constant_name: Callable[[str], str]) -> dict[str, torch.Tensor]:
        """The library's constant names -> the given tensors, each of the dtype it was compiled
        for: the library reads a constant's bytes as that dtype, so a mismatch is refused here
        (a bf16 copy of fp32 rotary tables once gave a bf16 MoE engine wrong keys, silently)."""
        bound: dict[str, torch.Tensor] = {}
        for index, (name, compiled_fqn) in enumerate(self._container.constant_names().items()):
            fqn = constant_name(compiled_fqn)
            tensor = constants.get(fqn)
            if tensor is None:
                raise EngineFormatError(f"the compiled step needs constant {name!r} ({fqn!r}), not in the weights file")
            expected = _SCALAR_TYPES.get(self._container.constant_dtype(index))
            if expected is not None and tensor.dtype != expected:
                raise EngineFormatError(
                    f"the compiled step reads constant {fqn!r} as {expected}, but it was given {tensor.dtype}"
                )
            bound[name] = tensor
        return bound

    def __call__(self, inputs: StepInputs, kv_pools: list[torch.Tensor]) -> torch.Tensor:
        (logits,) = self.run([*inputs.as_args(), *kv_pools])
        return logits

    def run(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The package's graph on its flat inputs, in their exported order."""
        if len(tensors) != self._container.num_inputs:
            raise ValueError(f"compiled step takes {self._container.num_inputs} tensors, got {len(tensors)}")
        return self._container.run(tensors)
