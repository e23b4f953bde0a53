"""Step cost models measured on this machine, kept by what the timing depends on, so a build of an
engine the machine has already timed reuses the fit instead of timing it again.

A build's last stage times its engine (builder/calibrate.py): 28 s for SmolLM2 and 191 s for a
1B-shaped Q4_K_M on 2 quiet cores (issue #39), the same figures every time the same shape is
built on the same machine. What a step costs depends on the network's shapes and formats, the
limits that bound the timed steps (max batch, max tokens, block size), the dtypes, the kernels' ISA,
the compiler and this CPU, not on the weights' values: the key is a hash of exactly those
(`CostModelKey`), so a fine-tune of a base model, or the same file rebuilt, reuses it. max_seq_len and
the KV pool's size are not in it: they change no step's cost, only how deep a context calibration
may time (runtime/step_budget/calibration.py: `deep`, `calibration_blocks`), so a fit timed with both at
least as large serves (the timed contexts cover the engine's), and a deeper engine times again and
replaces the entry. `ifb build --no-cache` times again (and stores the new fit); `ifb run --calibrate`
re-measures at start and stores its fit; a server whose engine has no fit here times it in its idle
turns and stores it (serving_cost_model.py). The runtime owns this store because the server reads and
writes it; the builder uses it through builder/calibrate.py.

Entries are one JSON file each, written to a temporary name and renamed into place (two builds
writing the same key leave one whole entry), carry a sha256 of their cost model that is checked on
use (an entry that fails it, or does not parse, is a miss with a warning, then replaced), and are
bounded: past MAX_ENTRIES the least recently used go.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ifb.runtime.step_budget.cost_model import StepCostModel

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "IFB_CACHE_DIR"
SUBDIR = "cost-models"
MAX_ENTRIES = 64  # a few KB each; a user who switches between dozens of shapes keeps them all
# ModelSpec fields that name a model rather than shape its computation
_NOT_COST = ("bos_token_id", "eos_token_ids")
# limits that only bound how deep calibration times contexts: a stored fit serves an engine whose are
# each no larger (see the module docstring)
_DEPTH_LIMITS = ("max_seq_len", "num_kv_blocks")


def cache_root() -> Path:
    """$IFB_CACHE_DIR, else $XDG_CACHE_HOME/ifb, else ~/.cache/ifb."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ifb"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class CostModelKey:
    """What an engine's step time depends on, as one JSON-able record; its hash names the entry.
    `depth`: the limits a stored fit must be timed at least as deep as (_DEPTH_LIMITS), not hashed."""

    record: dict[str, Any]
    depth: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, engine_record: dict[str, Any], builder_version: str) -> CostModelKey:
        """From an engine.json record (the engine as written, before its cost model)."""
        spec = {k: v for k, v in engine_record["model"].items() if k not in _NOT_COST}
        kernels = engine_record.get("kernels") or {}
        limits = engine_record["limits"]
        record = {
            "spec": spec,
            "limits": {name: value for name, value in limits.items() if name not in _DEPTH_LIMITS},
            "dtype": engine_record["dtype"],
            "kv_dtype": engine_record.get("kv_dtype"),
            "backend": engine_record["backend"],
            "step_constants_external": engine_record.get("step_constants_external"),
            # each chunk is one more container run a step (runtime/step/chunked_step.py)
            "layer_chunks": [[c["first_layer"], c["num_layers"]] for c in engine_record.get("layer_chunks") or []],
            "weight_formats": engine_record.get("weight_formats"),
            "weight_compute": engine_record.get("weight_compute"),
            "kernel_isa": kernels.get("isa"),
            # the library's own bytes: kernels rebuilt from other sources time differently (stop 51's
            # AVX2 change made 512-row int8 matmuls 10-24% faster under one builder version)
            "kernel_library_sha256": (engine_record.get("artifacts") or {}).get(kernels.get("path") or ""),
            "cpu_features": kernels.get("cpu_features"),
            "cpu": _cpu_name(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "builder": builder_version,
        }
        # as JSON gives it back (tuples become lists), so a stored key compares equal to a fresh one
        depth = {name: int(limits[name]) for name in _DEPTH_LIMITS if name in limits}
        return cls(json.loads(json.dumps(record)), depth)

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.record, sort_keys=True).encode()).hexdigest()


def _model_checksum(model: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(model, sort_keys=True).encode()).hexdigest()


class CostModelCache:
    """The cost models this machine measured, one file per key under `root`/cost-models."""

    def __init__(self, root: Path | None = None, max_entries: int = MAX_ENTRIES) -> None:
        self.folder = (root or cache_root()) / SUBDIR
        self.max_entries = max_entries

    def _path(self, key: CostModelKey) -> Path:
        return self.folder / f"{key.digest}.json"

    def get(self, key: CostModelKey) -> StepCostModel | None:
        """The stored fit for `key`, None on a miss (absent, unreadable, or failing its checksum)."""
        path = self._path(key)
        try:
            entry = json.loads(path.read_text())
            model = entry["cost_model"]
            if entry["checksum"] != _model_checksum(model) or entry["key"] != key.record:
                raise ValueError("checksum or key mismatch")
            found = StepCostModel.from_json(model)
            timed = {name: int(entry["depth"].get(name, 0)) for name in key.depth}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            logger.warning("cost model cache entry %s is unusable (%s); timing the engine again", path, error)
            return None
        shallower = [f"{name} {timed[name]} < {wanted}" for name, wanted in key.depth.items() if timed[name] < wanted]
        if shallower:
            logger.info(
                "stored step cost model was timed less deep (%s): timing the engine again", ", ".join(shallower)
            )
            return None
        os.utime(path)  # recently used: pruned last
        return found

    def put(self, key: CostModelKey, model: StepCostModel) -> None:
        """Store `model` under `key` atomically, then prune to max_entries. A cache that cannot be
        written (read-only home, full disk) costs only the reuse: a warning, never the build."""
        record = model.to_json()
        entry = {
            "key": key.record,
            "depth": key.depth,
            "cost_model": record,
            "checksum": _model_checksum(record),
            "measured_at": time.time(),
        }
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, prefix=".entry-", suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump(entry, out)
            os.replace(temporary, self._path(key))
            self._prune()
        except OSError as error:
            logger.warning("cost model not cached in %s: %s", self.folder, error)

    def _prune(self) -> None:
        used: dict[Path, float] = {}
        for path in self.folder.glob("*.json"):
            try:
                used[path] = path.stat().st_mtime
            except FileNotFoundError:  # pruned meanwhile by a concurrent build
                continue
        for stale in sorted(used, key=used.__getitem__, reverse=True)[self.max_entries :]:
            stale.unlink(missing_ok=True)
