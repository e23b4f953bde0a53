"""`ifb run` with several models: the TARGETs and --models-dir's entries as the router's models
(runtime/server/model_router.py), each loaded on its first request."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import click

from ifb.build_progress import BUILDS
from ifb.cli.model_needs import loaded_need, target_need
from ifb.runtime.engine_format import ENGINE_JSON
from ifb.runtime.runtime_config import RouterSettings, ServerSettings
from ifb.runtime.server.model_memory import MemoryNeed
from ifb.runtime.server.model_pool import LoadedModel, ModelSpec
from ifb.runtime.server.model_router import ModelRouter, create_models_app

logger = logging.getLogger(__name__)


def model_name(target: str) -> str:
    """An engine folder's or checkpoint folder's name, a file's stem, a hub id's last part."""
    path = Path(target)
    return path.stem if path.suffix == ".gguf" else path.name


def models_dir_targets(directory: Path) -> list[str]:
    """Every engine folder and .gguf file in `directory`, sorted; what else is there is logged."""
    found = []
    for entry in sorted(directory.iterdir()):
        if (entry / ENGINE_JSON).is_file() or (entry.is_file() and entry.suffix == ".gguf"):
            found.append(str(entry))
        else:
            logger.info("--models-dir: skipping %s (neither an engine folder nor a .gguf file)", entry)
    if not found:
        raise click.UsageError(f"--models-dir {directory} holds no engine folder and no .gguf file")
    return found


def named_targets(targets: tuple[str, ...], router: RouterSettings, served: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, target) per model: --served-model-name names the TARGETs in order (one each),
    else each is named by model_name."""
    if served and len(served) != len(targets):
        raise click.UsageError(
            f"with several models, --served-model-name names each TARGET once: got {len(served)} name(s) for "
            f"{len(targets)} TARGET(s) (--models-dir's models are named by their folder or file)"
        )
    named = list(zip(served or [model_name(t) for t in targets], targets, strict=True))
    if router.models_dir is not None:
        named += [(model_name(t), t) for t in models_dir_targets(Path(router.models_dir))]
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise click.UsageError(
            f"two models would be served as {', '.join(duplicates)}; name them with --served-model-name"
        )
    return named


def router_app(
    targets: tuple[str, ...],
    router: RouterSettings,
    server: ServerSettings,
    load: Callable[[str], LoadedModel],
) -> ModelRouter:
    """The router over the models; `load(target)` makes one's LLM (called on a worker thread)."""
    named = named_targets(targets, router, server.served_model_names)
    specs = [
        ModelSpec(
            name,
            _loader(load, target),
            target,
            _sizer(target),
            loaded_need=loaded_need,
            progress=partial(BUILDS.report, target),
        )
        for name, target in named
    ]
    logger.info("serving %d models: %s", len(specs), ", ".join(f"{n} ({t})" for n, t in named))
    return create_models_app(
        specs,
        server.app_options(),
        max_loaded_models=router.max_loaded_models,
        idle_unload_s=router.idle_unload_s,
        models_memory_gb=router.models_memory_gb,
    )


def _loader(load: Callable[[str], LoadedModel], target: str) -> Callable[[], LoadedModel]:
    return lambda: load(target)


def _sizer(target: str) -> Callable[[], MemoryNeed]:
    return lambda: target_need(target)


def check_many_models(targets: tuple[str, ...], params: Mapping[str, Any]) -> None:
    if params["prompt"] is not None:
        raise click.UsageError(f"--prompt answers with one model; got {len(targets)} TARGETs or --models-dir")
