"""Read a GGUF's header fast: metadata values (numeric arrays as numpy arrays, each string array in one
pass) and the tensor table, never the tensor data.

gguf's GGUFReader makes numpy views per array element: 17 s per read of a 262k-token vocabulary (its
tokens, scores and types) on the 2-core machine, quiet. This reader walks the header once, keeps the
values a caller asks for, and maps a tensor's bytes only when its `data` is asked for.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ifb.builder.errors import SourceError

# GGUF metadata value types: fixed-size scalars by numpy dtype; 8 is a string, 9 an array
_SCALAR_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


_DEFAULT_ALIGNMENT = 32  # llama.cpp's, where `general.alignment` is absent
# the element type GGUFReader gives a tensor's `data` of these ggml types; block formats are raw bytes
_ELEMENT_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One tensor of the table, as GGUFReader's ReaderTensor names its parts (`shape` innermost first)."""

    path: Path
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file

    @property
    def data(self) -> np.ndarray:
        """The tensor's values (block formats: uint8 [rows, row bytes]): a copy-on-write mapping of its own
        bytes (writable, so torch takes it without a copy; the file never changes), unmapped when the
        array is dropped, so a tensor packed or copied out leaves no page resident."""
        dtype = _ELEMENT_DTYPES.get(self.tensor_type.name)
        rows = tuple(reversed(self.shape))
        if dtype is None:
            dtype, rows = "<u1", (*rows[:-1], self.n_bytes // max(1, int(np.prod(rows[:-1], dtype=np.int64))))
        return np.memmap(self.path, dtype=dtype, mode="c", offset=self.data_offset, shape=rows)


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """A GGUF's metadata and tensor table. `fields`: the values of the keys asked for; `array_lengths`: the
    element count of every array (asked for or not: a vocabulary's size without reading its strings)."""

    fields: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[HeaderTensor, ...]


def without_vocabulary(key: str) -> bool:
    """A `wanted` for every value but the tokenizer's arrays (their lengths are still kept)."""
    return not key.startswith("tokenizer.ggml.") or key.endswith("_id") or key.startswith("tokenizer.ggml.add_")


def read_gguf_fields(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys `wanted` accepts: scalars as Python values, numeric arrays as numpy
    arrays, string arrays as lists (each walked once)."""
    return _read(path, wanted, tensors=False).fields


def read_gguf_header(path: Path, wanted: Callable[[str], bool]) -> GgufHeader:
    """read_gguf_fields' values, every array's length and the tensor table."""
    return _read(path, wanted, tensors=True)


def _read(path: Path, wanted: Callable[[str], bool], tensors: bool) -> GgufHeader:
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            fields, lengths, num_tensors, pos, alignment = _read_fields(buf, wanted)
            table = _read_tensors(path, buf, num_tensors, pos, alignment) if tensors else ()
            return GgufHeader(fields, lengths, table)
    except (struct.error, ValueError, UnicodeDecodeError, OSError) as error:
        raise SourceError(f"cannot read the metadata of GGUF {path}: {error}") from error


def _read_fields(buf: mmap.mmap, wanted: Callable[[str], bool]) -> tuple[dict[str, Any], dict[str, int], int, int, Any]:
    """(kept values, array lengths, tensor count, offset of the tensor table, general.alignment)"""
    if buf[:4] != b"GGUF":
        raise ValueError("the file does not start with the GGUF magic")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not 2 or 3")
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    alignment: Any = _DEFAULT_ALIGNMENT
    pos = 24
    for _ in range(num_fields):
        key, pos = _read_string(buf, pos)
        (value_type,) = _U32.unpack_from(buf, pos)
        keep = wanted(key)
        if value_type == _ARRAY:
            lengths[key] = struct.unpack_from("<IQ", buf, pos + 4)[1]
        value, pos = _read_value(buf, pos + 4, value_type, keep)
        if keep:
            fields[key] = value
        if key == "general.alignment":
            alignment = value
    return fields, lengths, num_tensors, pos, alignment


def _read_tensors(path: Path, buf: mmap.mmap, count: int, pos: int, alignment: Any) -> tuple[HeaderTensor, ...]:
    """The tensor table (name, dims innermost first, ggml type, offset in the data section), checked
    against the file's size."""
    import gguf

    entries = []
    for _ in range(count):
        name, pos = _read_string(buf, pos)
        (num_dims,) = _U32.unpack_from(buf, pos)
        shape = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        pos += 4 + 8 * num_dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        entries.append((name, shape, kind, offset))
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
    start = (pos + alignment - 1) // alignment * alignment
    table = []
    for name, shape, kind, offset in entries:
        tensor_type = gguf.GGMLQuantizationType(kind)
        block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        elements = int(np.prod(shape, dtype=np.int64))
        tensor = HeaderTensor(
            path, name, tensor_type, shape, elements, elements // block_size * type_size, start + offset
        )
        if tensor.data_offset + tensor.n_bytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        table.append(tensor)
    return tuple(table)


def _read_value(buf: mmap.mmap, pos: int, value_type: int, keep: bool) -> tuple[Any, int]:
    if value_type == _STRING:
        return _read_string(buf, pos)
    if value_type in _SCALAR_DTYPES:
        dtype = np.dtype(_SCALAR_DTYPES[value_type])
        value = np.frombuffer(buf[pos : pos + dtype.itemsize], dtype)[0].item()
        return (bool(value) if value_type == _BOOL else value), pos + dtype.itemsize
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element_type in _SCALAR_DTYPES:
        dtype = np.dtype(_SCALAR_DTYPES[element_type])
        end = pos + count * dtype.itemsize
        if end > len(buf):
            raise ValueError(f"an array of {count} values runs past the end of the file")
        if not keep:
            return None, end
        array = np.frombuffer(buf[pos:end], dtype)
        return (array.astype(bool) if element_type == _BOOL else array), end
    if element_type == _STRING:
        return _read_strings(buf, pos, count, keep)
    if element_type == _ARRAY:  # nested arrays: no tokenizer field uses them; walked past
        for _ in range(count):
            _, pos = _read_value(buf, pos, _ARRAY, False)
        return None, pos
    raise ValueError(f"unknown GGUF array element type {element_type}")


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError(f"a {length}-byte string runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_strings(buf: mmap.mmap, pos: int, count: int, keep: bool) -> tuple[list[str] | None, int]:
    """A string array in one pass: each element is a u64 length then its bytes, so the walk is sequential."""
    unpack = _U64.unpack_from
    if not keep:
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return None, pos
    values: list[str] = []
    append = values.append
    for _ in range(count):
        (length,) = unpack(buf, pos)
        pos += 8
        append(buf[pos : pos + length].decode("utf-8"))
        pos += length
    if pos > len(buf):
        raise ValueError(f"an array of {count} strings runs past the end of the file")
    return values, pos
