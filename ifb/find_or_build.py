"""Find or build the engine for an `ifb run` / `LLM(...)` target: an engine folder as given, else
an engine this ifb built earlier from the same source under engines/, else a new build ("rebuild
when the limits change"). Sits above the builder and the runtime; neither imports it.

Only engines this facade built itself are adopted: their build ids are recorded in
`engines/.ifb-built.json` when they are built. Any other folder under engines/ that claims the
same source is ignored (an engine runs native code; see the README's security note).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ifb.build_progress import BUILDS, forwarded_stages, report_stage, start_child
from ifb.builder.backends import STEP_PACKAGE
from ifb.builder.build import (
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    BuildOptions,
    BuildSummary,
    build_dtype,
    build_engine,
    build_kv_dtype,
)
from ifb.builder.quant_weights import resolve_compute, source_packs_weights
from ifb.builder.sources import ModelSource, resolve_source, source_sha256
from ifb.plugins.quant_formats import WeightCompute
from ifb.runtime.engine_format import ENGINE_JSON, BackendKind, EngineConfig
from ifb.runtime.errors import EngineFormatError

logger = logging.getLogger(__name__)

DEFAULT_ENGINES_DIR = Path("engines")
BUILT_REGISTRY = ".ifb-built.json"


def engine_name(source: ModelSource, options: BuildOptions) -> str:
    dtype = build_dtype(options, source)
    kv_dtype = build_kv_dtype(options, dtype)
    return (
        f"{source.name.lower()}-b{options.max_batch_size}-t{options.max_num_tokens}"
        f"-s{options.max_seq_len}-{dtype}"
        + ("" if kv_dtype == dtype else f"-kv{kv_dtype}")
        + ("" if options.weights == "auto" else f"-{options.weights}")
        + ("" if options.compute == "auto" else f"-compute{options.compute}")
        + ("" if options.backend is BackendKind.CPU else f"-{options.backend.value}")
    )


def _built_ids(engines_dir: Path) -> set[str]:
    path = engines_dir / BUILT_REGISTRY
    try:
        return set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _remember(engines_dir: Path, build_id: str) -> None:
    ids = _built_ids(engines_dir) | {build_id}
    (engines_dir / BUILT_REGISTRY).write_text(json.dumps(sorted(ids)) + "\n")


def _matches(engine: EngineConfig, source: ModelSource, sha256: str, options: BuildOptions, built: set[str]) -> bool:
    dtype = build_dtype(options, source)
    return (
        engine.build_id in built
        and engine.source.sha256 == sha256
        and engine.dtype == dtype
        and engine.kv_dtype == build_kv_dtype(options, dtype)
        and engine.build_options.weights == options.weights
        and engine.weight_compute == _compute(source, options)
        and engine.backend is BackendKind(options.backend)
        and engine.covers(
            max_batch_size=options.max_batch_size,
            max_num_tokens=options.max_num_tokens,
            max_seq_len=options.max_seq_len,
        )
    )


def _compute(source: ModelSource, options: BuildOptions) -> WeightCompute:
    """The compute mode `options` would build `source` with here (auto resolved: a dense engine
    built with --compute fp32 matches a request for auto)."""
    has_blocks = source_packs_weights(source, options.weights, options.backend)
    return resolve_compute(options.compute, has_blocks)


def _read_engine(folder: Path) -> EngineConfig | None:
    """The folder's engine.json as an EngineConfig (artifacts not hashed: only the record is
    compared), or None where it is missing or is no engine record this ifb reads."""
    try:
        return EngineConfig.load(folder, verify=False)
    except (EngineFormatError, OSError) as error:
        logger.debug("skipping %s: %s", folder, error)
        return None


def _is_engine_without_record(folder: Path) -> bool:
    """An engine folder that lost its engine.json: the builder's files and no checkpoint's
    config.json (told apart so the error names the missing file, not "not a checkpoint")."""
    engine_files = (WEIGHTS_FILE, STEP_PACKAGE, TOKENIZER_DIR)
    return not (folder / "config.json").exists() and any((folder / name).exists() for name in engine_files)


def find_or_build_engine(
    target: str | Path | None, options: BuildOptions, engines_dir: Path = DEFAULT_ENGINES_DIR
) -> Path:
    """An engine folder as given, else a matching engine built here earlier, else a new build."""
    if target is not None and (Path(target) / ENGINE_JSON).is_file():
        return Path(target)
    if target is not None and _is_engine_without_record(Path(target)):
        raise EngineFormatError(f"{target} is not an engine folder: {ENGINE_JSON} is missing")
    source = resolve_source(target)
    sha256 = source_sha256(source)
    built = _built_ids(engines_dir)
    if engines_dir.is_dir():
        for candidate in sorted(p for p in engines_dir.iterdir() if p.is_dir()):
            engine = _read_engine(candidate)
            if engine is not None and _matches(engine, source, sha256, options, built):
                logger.info("using engine %s", candidate)
                return candidate
    output = engines_dir / engine_name(source, options)
    logger.info("no engine under %s matches %s; building %s", engines_dir, source.name, output)
    if options.calibration == "auto":  # the first token does not wait for a calibration (issue #39)
        options = dataclasses.replace(options, calibration="serve")
    progress_key = str(target)  # the router asks BUILDS by its target (cli/many_models.py)
    try:
        build_in_child_process(target, output, options, on_stage=BUILDS.on_stage(progress_key))
    finally:
        BUILDS.finished(progress_key)
    _remember(engines_dir, EngineConfig.load(output, verify=False).build_id)
    return output


def build_in_child_process(
    target: str | Path | None,
    output: Path,
    options: BuildOptions,
    on_stage: Callable[[str], None] = lambda stage: None,
) -> BuildSummary:
    """The builder, called as a library in a fresh (spawned) process: the serving process keeps no
    OpenMP thread team of the builder's (see runtime/executor.py) and none of its memory.
    Each stage the build enters is handed to `on_stage` here; a BuildError raised there is raised here."""
    context = multiprocessing.get_context("spawn")
    with forwarded_stages(context, on_stage) as stages:
        with ProcessPoolExecutor(
            max_workers=1, mp_context=context, initializer=start_child, initargs=(stages,)
        ) as pool:
            return pool.submit(_build, target, output, options).result()


def _build(target: str | Path | None, output: Path, options: BuildOptions) -> BuildSummary:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = build_engine(target, output, options, on_stage=report_stage)
    phases = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in summary.stage_seconds.items())
    logger.info(
        "built %s in %.1fs (%s; step cost model %s)", summary.output, summary.seconds, phases, summary.cost_model
    )
    return summary
