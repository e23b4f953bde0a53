"""PrefixDiskTier: prefix-cache blocks evicted from RAM kept in files, so a shared prefix survives
eviction, idle unloads and restarts (`ifb run --prefix-cache-dir DIR --prefix-cache-disk-gb N`).

    DIR/<sha256(build id || block key)>.kv     one full block: every layer's K and V rows of its slots
    file = MAGIC | u32 header length | header (JSON: build id, key, dtype, shape) | payload | sha256(all before)

The block key is the prefix-hash chain (prefix_hash.py), which already mixes in the tenant's
cache_salt; the name adds the engine's build id, so a hit is the very block this engine would
have computed, never another engine's or another tenant's. A file that is truncated, has a
flipped byte or names another engine or key is refused (counted), removed, and is a miss.

The KV manager calls it through `BlockTier` (kv_cache_manager.py), on the step loop. spill copies
the block's bytes out of the pool (before the block is reused) and hands them to a writer thread
through a bounded queue; a full queue drops the spill (counted), so the loop never waits on the
disk. restore reads a file (or a spill not written yet), verifies it and copies it into a freshly
taken pool block. The files' bytes are bounded: least recently used (mtime) first out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ifb.runtime.engine_snapshot import DiskTierUsage
from ifb.runtime.errors import LimitExceededError
from ifb.runtime.kv_cache_manager import NO_TIER, BlockTier

logger = logging.getLogger(__name__)

MAGIC = b"IFBKV01\n"
SUFFIX = ".kv"
_LENGTH = struct.Struct("<I")
_DIGEST_BYTES = 32
DEFAULT_MAX_QUEUED_BLOCKS = 64  # spills waiting for the writer; each holds one block's rows in memory
BYTES_PER_GB = 10**9


@dataclass(frozen=True, slots=True)
class PrefixDiskTierConfig:
    directory: Path
    max_bytes: int
    max_queued_blocks: int = DEFAULT_MAX_QUEUED_BLOCKS


def block_file_name(build_id: str, key: bytes) -> str:
    """The file of the block whose prefix-hash chain is `key`, in the engine `build_id`."""
    return hashlib.sha256(build_id.encode() + key).hexdigest() + SUFFIX


class _Rejected(Exception):
    """A file that is not this engine's block for this key (the message says why)."""


@dataclass(frozen=True, slots=True)
class _Spill:
    name: str
    key: bytes
    rows: np.ndarray  # the block's bytes, [layers, K/V, block_size, kv_heads, head_dim * itemsize]


class PrefixDiskTier:
    """The BlockTier over one directory's files (module docstring)."""

    def __init__(self, config: PrefixDiskTierConfig, build_id: str, kv_cache: torch.Tensor, block_size: int) -> None:
        self.config = config
        self._closed = False
        self._build_id = build_id
        # kv_cache is the engine's pool, [layers, K/V, slots, kv_heads, head_dim].
        # Rows move as bytes, and on the CPU through numpy: torch splits a copy this small over its
        # threads, and on a loaded machine the OpenMP barrier made each block's copy 18 ms, not 0.5.
        self._pool_bytes = kv_cache.view(torch.uint8)
        self._host_bytes = self._pool_bytes.numpy() if kv_cache.device.type == "cpu" else None
        self._block_size = block_size
        self._shape = [kv_cache.shape[0], kv_cache.shape[1], block_size, *kv_cache.shape[3:]]
        self._dtype = str(kv_cache.dtype).removeprefix("torch.")
        self._byte_shape = [*self._shape[:-1], self._shape[-1] * kv_cache.element_size()]
        self._lock = threading.Lock()  # the index, the pending rows and the byte count: loop and writer
        self._files: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._pending: dict[str, np.ndarray] = {}  # spilled, not written yet
        self._num_bytes = 0
        self.hit_tokens = self.miss_tokens = self.bytes_written = self.bytes_read = 0
        self.dropped_spills = self.rejected_files = 0
        config.directory.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._queue: queue.Queue[_Spill | None] = queue.Queue(config.max_queued_blocks)
        self._writer = threading.Thread(target=self._write_loop, name="ifb-prefix-disk-writer", daemon=True)
        self._writer.start()

    def file_name(self, key: bytes) -> str:
        return block_file_name(self._build_id, key)

    # -- BlockTier ------------------------------------------------------------------------------
    def contains(self, block_hash: bytes) -> bool:
        name = self.file_name(block_hash)
        with self._lock:
            return name in self._files or name in self._pending

    def spill(self, block_hash: bytes, block_id: int, wait: bool = False) -> None:
        name = self.file_name(block_hash)
        if self._closed or self.contains(block_hash):
            return
        rows = self._copy_out(block_id)
        with self._lock:
            self._pending[name] = rows
        try:
            self._queue.put(_Spill(name, block_hash, rows), block=wait)
        except queue.Full:
            with self._lock:
                del self._pending[name]
            self.dropped_spills += 1

    def restore(self, block_hash: bytes, block_id: int) -> bool:
        if self._closed:
            return False
        name = self.file_name(block_hash)
        with self._lock:
            rows = self._pending.get(name)
            known = name in self._files
        if rows is None and known:
            rows = self._read(name, block_hash)
        if rows is None:
            return False
        self._copy_in(block_id, rows)
        self.hit_tokens += self._block_size
        return True

    def count_misses(self, num_blocks: int) -> None:
        self.miss_tokens += num_blocks * self._block_size

    def usage(self) -> DiskTierUsage:
        counts = (self.hit_tokens, self.miss_tokens, self.bytes_written, self.bytes_read, self.dropped_spills)
        return DiskTierUsage(*counts, self.rejected_files, self._num_bytes)

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._closed = True
        self._queue.put(None)
        self._writer.join()
        self._pool_bytes, self._host_bytes = self._pool_bytes.new_empty(0), None  # the pool goes with the engine

    def _copy_out(self, block_id: int) -> np.ndarray:
        slots = slice(block_id * self._block_size, (block_id + 1) * self._block_size)
        if self._host_bytes is not None:
            return np.ascontiguousarray(self._host_bytes[:, :, slots])
        return self._pool_bytes[:, :, slots].to("cpu", memory_format=torch.contiguous_format).numpy()

    def _copy_in(self, block_id: int, rows: np.ndarray) -> None:
        slots = slice(block_id * self._block_size, (block_id + 1) * self._block_size)
        if self._host_bytes is not None:
            np.copyto(self._host_bytes[:, :, slots], rows)
        else:
            self._pool_bytes[:, :, slots].copy_(torch.from_numpy(rows))

    # -- reading --------------------------------------------------------------------------------
    def _read(self, name: str, key: bytes) -> np.ndarray | None:
        path = self.config.directory / name
        try:
            with open(path, "rb") as file:  # read straight into a writable buffer: one copy, not two
                data = bytearray(os.fstat(file.fileno()).st_size)
                file.readinto(data)
            rows = self._parse(data, key)
        except OSError as error:  # removed under us (another server on this directory), or unreadable
            logger.warning("prefix disk tier: cannot read %s (%s); a miss", path, error)
            self._forget([name], unlink=False)
            return None
        except _Rejected as reason:
            logger.warning("prefix disk tier: refusing %s (%s); removed", path, reason)
            self.rejected_files += 1
            self._forget([name], unlink=True)
            return None
        self.bytes_read += len(data)
        try:
            os.utime(path)  # recently used: last in the LRU, across restarts too
        except OSError:
            pass  # removed since: the rows are read already
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
        return rows

    def _parse(self, data: bytearray, key: bytes) -> np.ndarray:
        head = len(MAGIC) + _LENGTH.size
        if len(data) < head + _DIGEST_BYTES or data[: len(MAGIC)] != MAGIC:
            raise _Rejected("not a block file, or truncated")
        body = memoryview(data)[: len(data) - _DIGEST_BYTES]
        if hashlib.sha256(body).digest() != data[len(data) - _DIGEST_BYTES :]:
            raise _Rejected("checksum mismatch")
        (header_len,) = _LENGTH.unpack_from(data, len(MAGIC))
        try:
            header = json.loads(bytes(data[head : head + header_len]))
        except ValueError as error:
            raise _Rejected(f"unreadable header: {error}") from None
        expected = self._header(key)
        if header != expected:
            raise _Rejected(f"header {header} is not this engine's block {expected}")
        count = len(body) - head - header_len
        if count != math.prod(self._byte_shape):
            raise _Rejected(f"payload of {count} bytes for shape {self._shape}")
        return np.frombuffer(data, dtype=np.uint8, count=count, offset=head + header_len).reshape(self._byte_shape)

    def _header(self, key: bytes) -> dict[str, Any]:
        return {"build_id": self._build_id, "key": key.hex(), "dtype": self._dtype, "shape": self._shape}

    # -- writing (the writer thread) -------------------------------------------------------------
    def _write_loop(self) -> None:
        while (spill := self._queue.get()) is not None:
            try:
                size: int | None = self._write_file(spill)
            except Exception:  # a full disk, say: this block is lost, the writer goes on
                logger.exception("prefix disk tier: writing %s failed", spill.name)
                size = None
            with self._lock:
                self._pending.pop(spill.name, None)
                if size is not None:
                    self._files[spill.name] = size
                    self._num_bytes += size
                    self.bytes_written += size
            self._prune()

    def _write_file(self, spill: _Spill) -> int:
        """Written under a temporary name and renamed: a reader never sees half a file."""
        header = json.dumps(self._header(spill.key)).encode()
        payload = spill.rows.reshape(-1).data
        prefix = MAGIC + _LENGTH.pack(len(header)) + header
        digest = hashlib.sha256(prefix)
        digest.update(payload)
        path = self.config.directory / spill.name
        temporary = path.with_name(f".{spill.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as file:
            file.write(prefix)
            file.write(payload)
            file.write(digest.digest())
        os.replace(temporary, path)
        return len(prefix) + payload.nbytes + _DIGEST_BYTES

    # -- the index and its bound ------------------------------------------------------------------
    def _scan(self) -> None:
        """The directory's block files (every engine's: they share the bound), oldest first."""
        found = []
        for entry in os.scandir(self.config.directory):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                stat = entry.stat()
                found.append((stat.st_mtime_ns, entry.name, stat.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
            self._num_bytes += size
        self._prune()
        logger.info(
            "prefix disk tier: %d files, %.1f MB in %s", len(self._files), self._num_bytes / 1e6, self.config.directory
        )

    def _prune(self) -> None:
        with self._lock:
            victims = []
            while self._num_bytes > self.config.max_bytes and self._files:
                name, size = self._files.popitem(last=False)
                self._num_bytes -= size
                victims.append(name)
        self._unlink(victims)

    def _forget(self, names: list[str], unlink: bool) -> None:
        with self._lock:
            for name in names:
                self._num_bytes -= self._files.pop(name, 0)
        if unlink:
            self._unlink(names)

    def _unlink(self, names: list[str]) -> None:
        for name in names:
            (self.config.directory / name).unlink(missing_ok=True)


def make_block_tier(
    config: PrefixDiskTierConfig | None, build_id: str, kv_cache: torch.Tensor, block_size: int
) -> BlockTier:
    """The one place that chooses: a disk tier when a directory was given, else none."""
    if config is None:
        return NO_TIER
    try:
        return PrefixDiskTier(config, build_id, kv_cache, block_size)
    except OSError as error:
        raise LimitExceededError(f"--prefix-cache-dir (prefix_cache_dir) {config.directory}: {error}") from error
