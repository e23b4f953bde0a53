"""find_or_build's choice of engine under engines/, without building one.

Pins which recorded engine serves which request: only one this facade built (its build id in
the registry), from the same source bytes, with the dtype, KV dtype, `--weights`, resolved
compute mode and backend the request would build with, and limits at least the requested ones.
Anything else, and a folder whose engine.json cannot be read as an EngineConfig, means a build.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from engine_records import LIMITS, engine_config

from ifb import find_or_build
from ifb.builder.build import BuildOptions, build_dtype, build_kv_dtype
from ifb.builder.sources import resolve_source, source_sha256
from ifb.plugins.quant_formats import WeightCompute
from ifb.runtime.engine_format import ENGINE_JSON, BackendKind, BuildOptionsRecord, EngineConfig, EngineSource


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A folder resolve_source takes for a Hugging Face checkpoint (only its bytes are hashed here)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text("{}\n")
    (folder / "model.safetensors").write_bytes(b"not read")
    return folder


def options(**changes: Any) -> BuildOptions:
    return BuildOptions(**{**LIMITS, **changes})


def engine_for(checkpoint: Path, request: BuildOptions, **changes: Any) -> EngineConfig:
    """The EngineConfig a build of `checkpoint` with `request` records, `changes` applied."""
    source = resolve_source(checkpoint)
    dtype = build_dtype(request, source)
    kv_dtype = build_kv_dtype(request, dtype)
    recorded: dict[str, Any] = dict(
        dtype=dtype,
        kv_dtype=kv_dtype,
        backend=request.backend,
        source=EngineSource(kind="hf_folder", path=str(checkpoint), sha256=source_sha256(source)),
        build_options=BuildOptionsRecord(
            **LIMITS,
            block_size=16,
            kv_blocks=64,
            dtype=request.dtype,
            backend=request.backend.value,
            weights=request.weights,
            kv_dtype=request.kv_dtype,
            compute=request.compute,
        ),
        weight_compute=find_or_build._compute(source, request),
    )
    return engine_config(**{**recorded, **changes})


def install(engines: Path, name: str, record: dict[str, Any] | str, built: bool = True) -> Path:
    folder = engines / name
    folder.mkdir(parents=True)
    (folder / ENGINE_JSON).write_text(record if isinstance(record, str) else json.dumps(record))
    if built and isinstance(record, dict):
        (engines / find_or_build.BUILT_REGISTRY).write_text(json.dumps([record["build_id"]]))
    return folder


requested: list[BuildOptions] = []  # what each fake build was asked for, in order


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Where find_or_build would build (the build itself replaced by writing a recorded engine)."""
    outputs: list[Path] = []

    def fake_build(target: Any, output: Path, request: BuildOptions, **_: object) -> None:
        requested.append(request)
        output.mkdir(parents=True)
        record = engine_for(Path(target), request, build_id=f"new-{len(outputs)}").to_json()
        (output / ENGINE_JSON).write_text(json.dumps(record))
        outputs.append(output)

    monkeypatch.setattr(find_or_build, "build_in_child_process", fake_build)
    return outputs


def test_a_build_for_a_source_leaves_calibration_to_the_server(
    checkpoint: Path, tmp_path: Path, builds: list[Path]
) -> None:
    """`ifb run SOURCE` / LLM(SOURCE): the build does not time the engine (calibration auto -> serve,
    issue #39: the first token waits for no calibration); an explicit choice is kept."""
    requested.clear()
    find(checkpoint, tmp_path / "a", options())
    find(checkpoint, tmp_path / "b", options(calibration="build"))
    assert [r.calibration for r in requested] == ["serve", "build"]


def find(checkpoint: Path, engines: Path, request: BuildOptions) -> Path:
    return find_or_build.find_or_build_engine(str(checkpoint), request, engines)


def test_an_engine_built_here_with_the_same_options_is_used(
    checkpoint: Path, tmp_path: Path, builds: list[Path]
) -> None:
    request = options()
    engine = install(tmp_path / "engines", "a", engine_for(checkpoint, request).to_json())
    assert find(checkpoint, tmp_path / "engines", request) == engine and builds == []


def test_larger_limits_serve_a_smaller_request(checkpoint: Path, tmp_path: Path, builds: list[Path]) -> None:
    engine = install(tmp_path / "engines", "a", engine_for(checkpoint, options()).to_json())
    smaller = options(max_batch_size=2, max_num_tokens=32, max_seq_len=64)
    assert find(checkpoint, tmp_path / "engines", smaller) == engine and builds == []


@pytest.mark.parametrize("limit", sorted(LIMITS))
def test_a_smaller_limit_does_not_serve(checkpoint: Path, tmp_path: Path, builds: list[Path], limit: str) -> None:
    install(tmp_path / "engines", "a", engine_for(checkpoint, options()).to_json())
    request = options(**{limit: LIMITS[limit] * 2})
    assert find(checkpoint, tmp_path / "engines", request) == builds[0]


@pytest.mark.parametrize(
    "changes",
    [
        {"build_id": "not-built-here"},
        {"source": EngineSource(kind="hf_folder", path="elsewhere", sha256="0" * 64)},
        {"dtype": "float16", "kv_dtype": "float16"},
        {"kv_dtype": "float16"},
        {"weight_compute": WeightCompute.INT8},
        {"backend": BackendKind.TENSORRT},
    ],
    ids=["not-in-registry", "other-source-bytes", "dtype", "kv-dtype", "compute", "backend"],
)
def test_a_different_engine_is_not_used(
    checkpoint: Path, tmp_path: Path, builds: list[Path], changes: dict[str, Any]
) -> None:
    engines = tmp_path / "engines"
    record = engine_for(checkpoint, options(), **changes).to_json()
    install(engines, "a", record, built=False)
    (engines / find_or_build.BUILT_REGISTRY).write_text(json.dumps(["build-1"]))
    found = find(checkpoint, engines, options())
    assert found == builds[0] and found.name != "a"
    assert json.loads((engines / find_or_build.BUILT_REGISTRY).read_text()) == ["build-1", "new-0"]


def test_the_weights_option_must_be_the_recorded_one(checkpoint: Path, tmp_path: Path, builds: list[Path]) -> None:
    quantized = options(weights="q8_0")
    install(tmp_path / "engines", "q8", engine_for(checkpoint, quantized).to_json())
    assert find(checkpoint, tmp_path / "engines", options()) == builds[0]
    assert find(checkpoint, tmp_path / "engines", quantized) == tmp_path / "engines" / "q8"


def test_a_dense_engine_built_with_compute_fp32_serves_compute_auto(
    checkpoint: Path, tmp_path: Path, builds: list[Path]
) -> None:
    engine = install(tmp_path / "engines", "a", engine_for(checkpoint, options(compute="fp32")).to_json())
    assert find(checkpoint, tmp_path / "engines", options(compute="auto")) == engine and builds == []


def test_an_engine_json_without_optional_fields_reads_with_their_defaults(
    checkpoint: Path, tmp_path: Path, builds: list[Path]
) -> None:
    """Engines written before kv_dtype / weight_compute / build_options.weights existed."""
    record = engine_for(checkpoint, options()).to_json()
    assert record["dtype"] == record["kv_dtype"] and record["weight_compute"] == "fp32"
    del record["kv_dtype"], record["weight_compute"], record["build_options"]["weights"]
    engine = install(tmp_path / "engines", "old", record)
    assert find(checkpoint, tmp_path / "engines", options()) == engine and builds == []


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "{}"], ids=["invalid-json", "not-an-object", "empty"])
def test_an_unreadable_engine_json_is_skipped(checkpoint: Path, tmp_path: Path, builds: list[Path], text: str) -> None:
    install(tmp_path / "engines", "broken", text)
    assert find(checkpoint, tmp_path / "engines", options()) == builds[0]


def test_a_target_engine_folder_is_used_as_given(checkpoint: Path, tmp_path: Path, builds: list[Path]) -> None:
    engine = install(tmp_path / "elsewhere", "a", engine_for(checkpoint, options()).to_json(), built=False)
    assert find_or_build.find_or_build_engine(str(engine), options(max_batch_size=99), tmp_path / "engines") == engine
    assert builds == []
