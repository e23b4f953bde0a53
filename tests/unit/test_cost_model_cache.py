"""The step cost model cache (runtime/step_budget/cost_model_cache.py): a build reuses the fit this machine
measured for the same key, misses on anything the timing depends on, survives corrupt entries and
concurrent writers, and stays bounded; `--no-cache` times the engine again."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from tiny_models import TINY_LIMITS

from ifb.builder import calibrate as calibrate_module
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.calibrate import calibrate_engine_folder
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.step_budget.calibration import NOISY_FIT
from ifb.runtime.step_budget.cost_model import StepCostModel
from ifb.runtime.step_budget.cost_model_cache import CostModelCache, CostModelKey

MODEL = StepCostModel(4.0, 0.25, 0.5, 0.001, 1e-6, 0.1)


def engine_record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "model": {"architecture": "llama", "hidden_size": 64, "num_layers": 2, "bos_token_id": 1, "eos_token_ids": [2]},
        "limits": {
            "max_batch_size": 4,
            "max_num_tokens": 64,
            "max_seq_len": 128,
            "block_size": 16,
            "num_kv_blocks": 64,
        },
        "dtype": "fp32",
        "kv_dtype": "fp32",
        "backend": "cpu",
        "weight_formats": {},
        "weight_compute": "fp32",
        # cpu_features a tuple, as EngineConfig.to_json gives it (a stored key reads back a list)
        "kernels": {"path": "kernels/lib.so", "isa": "avx512_vnni", "cpu_features": ("avx2", "avx512f")},
        "artifacts": {"kernels/lib.so": "a" * 64, "step.pt2": "b" * 64},
    }
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = record
        for name in parents:
            target = target[name]
        target[leaf] = value
    return record


def key(**changes: Any) -> CostModelKey:
    return CostModelKey.of(engine_record(**changes), "0.1.0")


def test_a_stored_model_is_found_under_its_key_only(tmp_path: Path) -> None:
    cache = CostModelCache(tmp_path)
    cache.put(key(), MODEL)
    assert cache.get(key()) == MODEL
    # a fine-tune: other token ids, the same computation
    assert cache.get(key(**{"model.eos_token_ids": [7, 8], "model.bos_token_id": 0})) == MODEL
    # other weights of the same shapes: the same computation (the step package is not the key's)
    assert cache.get(key(artifacts={"kernels/lib.so": "a" * 64, "step.pt2": "c" * 64})) == MODEL
    for change in (
        {"model.hidden_size": 128},
        {"limits.max_num_tokens": 128},
        {"limits.max_batch_size": 8},
        {"limits.block_size": 32},
        {"dtype": "bf16"},
        {"kv_dtype": "fp16"},
        {"weight_compute": "int8"},
        {"weight_formats": {"lm_head": "q8_0"}},
        {"kernels.isa": "avx2"},
        {"artifacts": {"kernels/lib.so": "d" * 64}},  # the kernel library rebuilt from other sources
    ):
        assert cache.get(key(**change)) is None, change
    assert cache.get(CostModelKey.of(engine_record(), "0.2.0")) is None


def test_a_fit_timed_at_least_as_deep_serves_other_context_and_pool_limits(tmp_path: Path) -> None:
    """max_seq_len and the KV pool size change no step's cost, only how deep calibration times
    contexts: a fit timed with both at least as large serves; a deeper engine times again, and its fit
    then serves the shallower ones too."""
    cache = CostModelCache(tmp_path)
    deep = {"limits.max_seq_len": 4096, "limits.num_kv_blocks": 1024}
    cache.put(key(**deep), MODEL)
    assert cache.get(key()) == MODEL  # 128 tokens, 64 blocks
    assert cache.get(key(**{**deep, "limits.max_seq_len": 2048})) == MODEL
    assert cache.get(key(**{**deep, "limits.max_seq_len": 8192})) is None
    assert cache.get(key(**{**deep, "limits.num_kv_blocks": 2048})) is None
    deeper = StepCostModel(5.0, 0.25, 0.5, 0.001, 1e-6, 0.1)
    cache.put(key(**{"limits.max_seq_len": 8192, "limits.num_kv_blocks": 2048}), deeper)
    assert cache.get(key(**deep)) == deeper
    assert len(list(cache.folder.glob("*.json"))) == 1  # one entry per key, whatever the depth


@pytest.mark.parametrize("damage", ["checksum", "truncated", "key"])
def test_a_damaged_entry_is_a_miss_with_a_warning_and_is_replaced(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = CostModelCache(tmp_path)
    cache.put(key(), MODEL)
    (path,) = cache.folder.glob("*.json")
    entry = json.loads(path.read_text())
    if damage == "checksum":
        entry["cost_model"]["base_ms"] = 1.0
        path.write_text(json.dumps(entry))
    elif damage == "key":  # a hash collision, or an entry copied under another name
        entry["key"]["dtype"] = "bf16"
        path.write_text(json.dumps(entry))
    else:
        path.write_text(path.read_text()[:40])
    with caplog.at_level(logging.WARNING, logger="ifb.runtime.step_budget.cost_model_cache"):
        assert cache.get(key()) is None
    assert "unusable" in caplog.text
    cache.put(key(), MODEL)
    assert cache.get(key()) == MODEL


def test_the_cache_keeps_the_most_recently_used_entries(tmp_path: Path) -> None:
    cache = CostModelCache(tmp_path, max_entries=3)
    keys = [key(**{"model.hidden_size": 64 * (i + 1)}) for i in range(5)]
    for index, each in enumerate(keys[:3]):
        cache.put(each, MODEL)
        os.utime(cache.folder / f"{each.digest}.json", (1000 * (index + 1),) * 2)  # no ties on a coarse clock
    assert cache.get(keys[0]) == MODEL  # used now: it outlives keys[1] and keys[2]
    cache.put(keys[3], MODEL)
    cache.put(keys[4], MODEL)
    assert len(list(cache.folder.glob("*.json"))) == 3
    assert [cache.get(each) is not None for each in keys] == [True, False, False, True, True]


def test_concurrent_writers_never_leave_a_partial_entry(tmp_path: Path) -> None:
    """Readers racing writers of the same key see the whole entry or none, never a torn one."""
    cache = CostModelCache(tmp_path)
    models = [StepCostModel(float(i), 0.25, 0.5, 0.001, 1e-6, 0.1) for i in range(1, 9)]
    seen: list[StepCostModel | None] = []
    failures: list[BaseException] = []

    def write(model: StepCostModel) -> None:
        try:
            for _ in range(50):
                CostModelCache(tmp_path).put(key(), model)
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    def read() -> None:
        for _ in range(400):
            seen.append(cache.get(key()))

    threads = [threading.Thread(target=write, args=(m,)) for m in models] + [threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert all(found is None or found in models for found in seen)
    assert cache.get(key()) in models
    assert not list(cache.folder.glob(".entry-*")), "temporary files left behind"


def test_a_build_reuses_the_cost_model_and_no_cache_measures_again(
    tiny_llama_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a copy of the session's tiny engine: the first calibration measures and stores, the second
    reuses the stored fit (engine.json says which), `reuse=False` (`--no-cache`) measures again.
    Each timing gives a fit of its own (the real timing is step_budget's tests'), so which one an
    engine ends with says where it came from, on a busy machine too."""
    fits = iter(StepCostModel(float(n), 0.25, 0.5, 0.001, 1e-6, 0.1) for n in range(1, 10))
    monkeypatch.setattr(calibrate_module, "calibrate", lambda engine: next(fits))
    folder = tmp_path / "engine"
    shutil.copytree(tiny_llama_engine, folder)
    cache = CostModelCache(tmp_path / "cache")
    measured = calibrate_engine_folder(folder, dict, reuse=True, cache=cache)
    assert measured is not None and measured.base_ms == 1.0
    assert EngineConfig.load(folder).build_info["cost_model"] == "measured"
    reused = calibrate_engine_folder(folder, dict, reuse=True, cache=cache)
    config = EngineConfig.load(folder)
    assert reused == measured and config.cost_model == measured and config.build_info["cost_model"] == "reused"
    again = calibrate_engine_folder(folder, dict, reuse=False, cache=cache)
    assert again is not None and again.base_ms == 2.0
    assert EngineConfig.load(folder).build_info["cost_model"] == "measured"
    assert cache.get(CostModelKey.of(copy.deepcopy(config.to_json()), config.builder_version)) == again


def test_a_noisy_fit_is_not_cached(tiny_llama_engine: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit timed on a busy machine (worst error past NOISY_FIT) serves its own engine only."""
    folder = tmp_path / "engine"
    shutil.copytree(tiny_llama_engine, folder)
    cache = CostModelCache(tmp_path / "cache")
    noisy = StepCostModel(4.0, 0.25, 0.5, 0.001, 1e-6, NOISY_FIT + 0.1)
    monkeypatch.setattr(calibrate_module, "calibrate", lambda engine: noisy)
    assert calibrate_engine_folder(folder, dict, reuse=True, cache=cache) == noisy
    assert EngineConfig.load(folder).cost_model == noisy
    assert not list(cache.folder.glob("*.json"))


def test_ifb_build_takes_the_session_cache(tiny_llama_dir: Path, tiny_llama_engine: Path, tmp_path: Path) -> None:
    """A rebuild of the session's tiny engine (same source, same options) takes the fit stored under
    its key in the cache `ifb build` uses ($IFB_CACHE_DIR: the session's own, tests/conftest.py)."""
    built = EngineConfig.load(tiny_llama_engine)
    CostModelCache().put(CostModelKey.of(built.to_json(), built.builder_version), MODEL)
    build_engine(tiny_llama_dir, tmp_path / "again", BuildOptions(dtype="fp32", compute="fp32", **TINY_LIMITS))
    rebuilt = EngineConfig.load(tmp_path / "again")
    assert rebuilt.build_info["cost_model"] == "reused" and rebuilt.cost_model == MODEL
