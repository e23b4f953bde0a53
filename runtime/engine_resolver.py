"""Find the engine for an `ifb run` / `LLM(...)` argument: an engine folder, or a model SOURCE
for which a matching engine under engines/ is reused or built ("rebuild when limits change")."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from ifb.builder.build import Backend, BuildOptions, build_dtype
from ifb.builder.engine_writer import ENGINE_JSON
from ifb.builder.errors import BuildError
from ifb.builder.sources import resolve_source, source_sha256

logger = logging.getLogger(__name__)

DEFAULT_ENGINES_DIR = Path("engines")


def engine_name(source_name: str, options: BuildOptions) -> str:
    return (
        f"{source_name.lower()}-b{options.max_batch_size}-t{options.max_num_tokens}"
        f"-s{options.max_seq_len}-{build_dtype(options)}"
        + ("" if options.backend is Backend.CPU else f"-{options.backend.value}")
    )


def _matches(record: dict, sha256: str, options: BuildOptions) -> bool:
    limits = record.get("limits", {})
    return (
        record.get("source", {}).get("sha256") == sha256
        and record.get("dtype") == build_dtype(options)
        and record.get("backend") == options.backend.value
        and limits.get("max_batch_size", 0) >= options.max_batch_size
        and limits.get("max_num_tokens", 0) >= options.max_num_tokens
        and limits.get("max_seq_len", 0) >= options.max_seq_len
    )


def find_or_build_engine(
    target: str | Path | None, options: BuildOptions, engines_dir: Path = DEFAULT_ENGINES_DIR
) -> Path:
    """An engine folder as given, else a matching one under `engines_dir`, else a new build."""
    if target is not None and (Path(target) / ENGINE_JSON).is_file():
        return Path(target)
    source = resolve_source(target)
    sha256 = source_sha256(source)
    if engines_dir.is_dir():
        for candidate in sorted(engines_dir.iterdir()):
            path = candidate / ENGINE_JSON
            if path.is_file() and _matches(json.loads(path.read_text()), sha256, options):
                logger.info("using engine %s", candidate)
                return candidate
    output = engines_dir / engine_name(source.name, options)
    logger.info("no engine under %s matches %s; building %s", engines_dir, source.name, output)
    build_in_subprocess(target, output, options)
    return output


def build_in_subprocess(target: str | Path | None, output: Path, options: BuildOptions) -> None:
    """`ifb build` in a child process: the serving process keeps no OpenMP thread team of the
    builder's (see executor.py) and none of its memory."""
    command = [sys.executable, "-m", "ifb.cli.main", "build"] + ([str(target)] if target is not None else [])
    command += [
        "--max-batch-size",
        str(options.max_batch_size),
        "--max-num-tokens",
        str(options.max_num_tokens),
        "--max-seq-len",
        str(options.max_seq_len),
        "--block-size",
        str(options.block_size),
        "--dtype",
        options.dtype,
        "--backend",
        options.backend.value,
        "-o",
        str(output),
    ]
    if options.kv_blocks is not None:
        command += ["--kv-blocks", str(options.kv_blocks)]
    if options.kv_memory_gb is not None:
        command += ["--kv-memory", str(options.kv_memory_gb)]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise BuildError(f"building {output} failed (exit {result.returncode}); see the messages above")
    sys.stderr.write(result.stdout)
