"""The engine's weights file: safetensors, written one tensor at a time and mapped, not read.

The format is plain safetensors (an 8-byte header length, a JSON header of dtype/shape/offsets,
then the bytes), so `safetensors.torch.load_file` reads it too. What this file adds is how it
moves: `WeightsWriter` writes the header from the tensors' shapes first and then each tensor as
it is produced, so a build never holds the whole state (safetensors' `save_file` builds every
tensor's bytes in memory first); `map_weights` returns tensors that alias a copy-on-write
mapping of the file, so loading an engine costs page cache, not a second copy of its weights.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int32: "I32",
    torch.int64: "I64",
}
_TORCH = {name: dtype for dtype, name in _DTYPES.items()}
_HEADER_ALIGN = 8  # safetensors pads its header so the data section starts 8-byte aligned


@dataclass(frozen=True, slots=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def num_bytes(self) -> int:
        return torch.Size(self.shape).numel() * self.itemsize


class WeightsWriter:
    """Writes a safetensors file whose tensor list is fixed up front; tensors arrive in any order."""

    def __init__(self, path: Path, entries: Mapping[str, TensorEntry]) -> None:
        self.path, self.entries = path, dict(entries)
        self._offsets: dict[str, int] = {}
        header: dict[str, object] = {}
        offset = 0
        # safetensors allows no gaps between tensors; laid out widest element first, every tensor
        # starts at a multiple of its own element size.
        for name, entry in sorted(self.entries.items(), key=lambda item: -item[1].itemsize):
            self._offsets[name] = offset
            header[name] = {
                "dtype": _DTYPES[entry.dtype],
                "shape": list(entry.shape),
                "data_offsets": [offset, offset + entry.num_bytes],
            }
            offset += entry.num_bytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        padded = -(-len(encoded) // _HEADER_ALIGN) * _HEADER_ALIGN
        encoded += b" " * (padded - len(encoded))
        self._data_start = 8 + len(encoded)
        self._file: BinaryIO = path.open("wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)
        self._file.truncate(self._data_start + offset)
        self._written: set[str] = set()
        self._bytes_at: dict[str, int] = {}  # bytes `write_at` wrote so far, per tensor
        self._lock = threading.Lock()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries.get(name)
        if entry is None:
            raise ValueError(f"{name} is not in the weights file's tensor list")
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the file expects {entry.shape}")
        data = tensor.detach().to(entry.dtype).contiguous()
        self._file.seek(self._data_start + self._offsets[name])
        self._file.write(data.view(torch.uint8).reshape(-1).numpy().data)
        self._written.add(name)

    def write_at(self, name: str, offset: int, data: memoryview | bytes) -> None:
        """Bytes of `name` from byte `offset` of it, for a tensor produced in pieces; safe from several
        threads (positioned writes). It counts as written once all its bytes have come."""
        entry = self.entries.get(name)
        if entry is None:
            raise ValueError(f"{name} is not in the weights file's tensor list")
        view = memoryview(data).cast("B")
        size = view.nbytes
        if offset < 0 or offset + size > entry.num_bytes:
            raise ValueError(f"{name}: bytes {offset}..{offset + size} of a {entry.num_bytes}-byte tensor")
        at = self._data_start + self._offsets[name] + offset
        while view.nbytes:  # a regular file takes it in one call but for a signal or a full disk
            done = os.pwrite(self._file.fileno(), view, at)
            view, at = view[done:], at + done
        with self._lock:
            self._bytes_at[name] = self._bytes_at.get(name, 0) + size
            if self._bytes_at[name] == entry.num_bytes:
                self._written.add(name)

    def close(self) -> None:
        self._file.close()
        missing = sorted(set(self.entries) - self._written)
        if missing:
            raise ValueError(f"weights file {self.path} lacks {', '.join(missing[:8])}")


def map_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, aliasing a private (copy-on-write) mapping of it."""
    with path.open("rb") as file:
        (header_len,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_len))
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _TORCH[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = (
            torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin)
            if count
            else torch.empty(0, dtype=dtype)
        )
        tensors[name] = flat.reshape(info["shape"])
    return tensors
