"""The compile cache (builder/artifact_cache.py): an artifact is found under its own key only,
checked on use (a corrupt entry is a miss and goes), left whole by concurrent writers, bounded, and
bypassed by `--no-cache`; a block engine built from another file of the same shapes takes its
compiled kernels and step from it, and computes what a freshly compiled one does."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from family_checks import assert_step_modes_agree
from tiny_models import TINY_LIMITS, write_gguf, write_hf_checkpoint

from ifb.builder.artifact_cache import ARTIFACT, SUBDIR, ArtifactCache, ArtifactKey
from ifb.builder.build import BuildOptions, build_engine
from ifb.builder.compile_cpu import kernel_library_key
from ifb.cli.main import cli
from ifb.plugins.quant_build import QuantIsa
from ifb.runtime.engine_format import EngineConfig


def key(**record: object) -> ArtifactKey:
    return ArtifactKey.of("step", {"graph": "g", "torch": "2.13.0", **record})


def artifact(tmp_path: Path, content: bytes, name: str = "made.pt2") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    return path


def test_an_artifact_is_found_under_its_key_only(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    cache.store(key(), artifact(tmp_path, b"compiled code"))
    assert cache.fetch(key(), tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"compiled code"
    assert not cache.fetch(key(graph="another graph"), tmp_path / "other")
    assert not cache.fetch(ArtifactKey.of("kernels", key().record), tmp_path / "other")
    assert not (tmp_path / "other").exists()


def test_no_cache_compiles_again_and_stores(tmp_path: Path) -> None:
    """`--no-cache`: the stored artifact is not used, and the new one replaces nothing but is kept."""
    ArtifactCache(tmp_path / "cache").store(key(), artifact(tmp_path, b"old"))
    fresh = ArtifactCache(tmp_path / "cache", reuse=False)
    assert not fresh.fetch(key(), tmp_path / "out")
    fresh.store(key(graph="new"), artifact(tmp_path, b"new"))
    assert ArtifactCache(tmp_path / "cache").fetch(key(graph="new"), tmp_path / "out")


@pytest.mark.parametrize("damage", ["artifact", "record"])
def test_a_damaged_entry_is_a_miss_and_is_removed(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    cache.store(key(), artifact(tmp_path, b"compiled code"))
    entry = tmp_path / "cache" / SUBDIR / "step" / key().digest
    if damage == "artifact":
        (entry / ARTIFACT).write_bytes(b"compiled cod\x00")  # same size, one byte flipped
    else:
        (entry / "entry.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="ifb.builder.artifact_cache"):
        assert not cache.fetch(key(), tmp_path / "out")
    assert "unusable" in caplog.text and str(entry) in caplog.text
    assert not entry.exists() and not (tmp_path / "out").exists()
    cache.store(key(), artifact(tmp_path, b"compiled code"))  # replaced by the next build
    assert cache.fetch(key(), tmp_path / "out")


def test_concurrent_writers_of_one_key_leave_one_whole_entry(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache")
    sources = [artifact(tmp_path, bytes([n]) * 100_000, f"made-{n}") for n in range(8)]
    start = threading.Barrier(len(sources))
    failures: list[BaseException] = []

    def write(source: Path) -> None:
        try:
            start.wait()
            cache.store(key(), source)
        except BaseException as error:  # noqa: BLE001  (reported below)
            failures.append(error)

    threads = [threading.Thread(target=write, args=(source,)) for source in sources]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert cache.fetch(key(), tmp_path / "out")
    assert (tmp_path / "out").read_bytes() in {source.read_bytes() for source in sources}
    assert [p.name for p in (tmp_path / "cache" / SUBDIR / "step").iterdir()] == [key().digest]


def test_the_cache_is_bounded_least_recently_used_out(tmp_path: Path) -> None:
    cache = ArtifactCache(tmp_path / "cache", max_entries=3, max_bytes=10_000)
    for n in range(3):
        cache.store(key(n=n), artifact(tmp_path, b"x" * 1000))
    assert cache.fetch(key(n=0), tmp_path / "out")  # used: the oldest now is n=1
    cache.store(key(n=3), artifact(tmp_path, b"x" * 1000))
    assert [cache.fetch(key(n=n), tmp_path / "out") for n in range(4)] == [True, False, True, True]
    cache.store(key(n=4), artifact(tmp_path, b"x" * 9500))  # past max_bytes: only it stays
    assert [cache.fetch(key(n=n), tmp_path / "out") for n in range(5)] == [False, False, False, False, True]


def test_another_file_of_the_same_shapes_reuses_the_compiled_step(
    tiny_q4_gguf_engine: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The session's tiny Q4_1 engine was compiled into the session's cache ($IFB_CACHE_DIR,
    tests/conftest.py); another model of the same shapes (other weights) takes its kernels and step
    from there, and its compiled step computes what its reference and eager modes do (so the
    reused package is bound to this file's weights, not the first's); other limits compile anew."""
    root = tmp_path_factory.mktemp("same-shapes")
    other = write_gguf(
        root / "other.gguf", write_hf_checkpoint(root / "hf", seed=7), linear_type="Q4_1", embed_type="Q8_0"
    )
    options = dict(dtype="auto", compute="fp32", **TINY_LIMITS)
    build_engine(other, root / "engine", BuildOptions(**options))  # type: ignore[arg-type]
    assert EngineConfig.load(root / "engine").build_info["compile_cache_reused"] == ["kernels", "step"]
    assert_step_modes_agree(root / "engine")
    wider = {**options, "max_num_tokens": 96}
    build_engine(other, root / "wider", BuildOptions(**wider))  # type: ignore[arg-type]
    assert EngineConfig.load(root / "wider").build_info["compile_cache_reused"] == ["kernels"]


def test_ifb_kernels_compiles_the_library_into_the_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ifb kernels` (`make install` runs it) compiles this CPU's kernel library into the compile
    cache, under the key an engine build looks it up by; run again, it finds it and compiles nothing."""
    monkeypatch.setenv("IFB_CACHE_DIR", str(tmp_path / "cache"))
    first = CliRunner().invoke(cli, ["kernels"])
    assert first.exit_code == 0, first.output
    assert "compiled in" in first.output
    isa = QuantIsa(first.output.split("(", 1)[1].split(")", 1)[0])
    assert ArtifactCache().fetch(kernel_library_key(isa), tmp_path / "library.so")
    assert (tmp_path / "library.so").stat().st_size > 0
    again = CliRunner().invoke(cli, ["kernels"])
    assert again.exit_code == 0, again.output
    assert f"kernel library ({isa.value}): already in {tmp_path / 'cache' / SUBDIR}" in again.output
