"""The `LLM` users import: a model source or an engine folder in, a running runtime `LLM` out.

The runtime's `LLM` takes only an engine folder; finding or building that folder from a model
source is this facade's one job (ifb/find_or_build.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ifb.builder.build import BuildOptions
from ifb.find_or_build import DEFAULT_ENGINES_DIR, find_or_build_engine
from ifb.runtime.llm import LLM as RuntimeLLM


class LLM(RuntimeLLM):
    """`LLM(engine_or_source, **runtime_settings)`; a SOURCE reuses or builds an engine first."""

    def __init__(
        self,
        target: str | Path | None = None,
        *,
        build_options: BuildOptions | None = None,
        engines_dir: Path = DEFAULT_ENGINES_DIR,
        **settings: Any,
    ) -> None:
        super().__init__(find_or_build_engine(target, build_options or BuildOptions(), engines_dir), **settings)
