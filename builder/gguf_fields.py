"""Read a GGUF's metadata values fast: numeric arrays as numpy arrays, each string array in one pass.

gguf's GGUFReader makes numpy views per array element: ~40 s for a 262k-token vocabulary (its tokens,
scores and types) on the 2-core machine. This reader walks the key/value section of the header only,
keeps the values a caller asks for, and never touches the tensor data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
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


def read_gguf_fields(path: Path, wanted: Callable[[str], bool]) -> dict[str, Any]:
    """The metadata values whose keys `wanted` accepts: scalars as Python values, numeric arrays as numpy
    arrays, string arrays as lists (each walked once; gguf's GGUFReader takes ~40 s on a 262k vocabulary
    because it makes numpy views per element)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _read_fields(buf, wanted)
    except (struct.error, ValueError, UnicodeDecodeError) as error:
        raise SourceError(f"cannot read the metadata of GGUF {path}: {error}") from error


def _read_fields(buf: mmap.mmap, wanted: Callable[[str], bool]) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ValueError("the file does not start with the GGUF magic")
    version, _, num_fields = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not 2 or 3")
    fields: dict[str, Any] = {}
    pos = 24
    for _ in range(num_fields):
        key, pos = _read_string(buf, pos)
        (value_type,) = _U32.unpack_from(buf, pos)
        keep = wanted(key)
        value, pos = _read_value(buf, pos + 4, value_type, keep)
        if keep:
            fields[key] = value
    return fields


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
