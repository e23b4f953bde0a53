"""ifb: an in-flight batching LLM engine. `from ifb import LLM, SamplingParams`."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "__version__"]
__version__ = "0.1.0"  # also in pyproject.toml; `ifb --version`, /version and the OpenAPI doc report it


def __getattr__(name: str) -> Any:
    # Lazy, so `import ifb.builder` does not pull in the whole runtime (nor the runtime the builder).
    if name == "LLM":
        from ifb.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ifb.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
