"""FrontendClient: what both engine clients (the in-process LLM, runtime/llm.py, and the Ray
replica set, ifb/ray_serve/proxy.py) do alike on the caller's side: read engine.json and the
tokenizer, resolve the runtime settings, and answer the EngineClient's frontend members
(tokenize, chat template, detokenize, model info, capacity) with one Frontend, running blocking
work on a small bounded pool so async callers never block their event loop."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ifb.runtime.engine_client import ModelInfo
from ifb.runtime.engine_format import EngineConfig
from ifb.runtime.frontend import Frontend, Prompt
from ifb.runtime.runtime_config import RuntimeConfig, RuntimeSettings, resolve_runtime_config

T = TypeVar("T")
FRONTEND_WORKERS = 2  # concurrent tokenizations/compiles for async callers: bounded, off the loop


class FrontendClient:
    def __init__(self, engine: str | Path, settings: RuntimeSettings, verify: bool = True) -> None:
        """`verify=False` skips hashing the artifacts (a process that never loads them)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.settings = settings
        self.engine_config = EngineConfig.load(engine, verify=verify)
        self.config: RuntimeConfig = resolve_runtime_config(self.engine_config, settings)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.engine_config.tokenizer_path))
        self.frontend = Frontend(self.engine_config, self.config, self.tokenizer, settings.chat_template)
        self._workers = ThreadPoolExecutor(max_workers=FRONTEND_WORKERS, thread_name_prefix="ifb-frontend")

    @property
    def model_name(self) -> str:
        return self.engine_config.model_name

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(self.engine_config.model_name, self.engine_config.limits.max_seq_len)

    @property
    def capacity(self) -> int:
        """One engine's admission limit (every choice of a response is seated on one engine)."""
        return self.config.max_batch_size + self.config.max_queued_requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.frontend.tokenize(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        return self.frontend.apply_chat_template(messages, tools, chat_template_kwargs)

    @property
    def chat_template(self) -> str | None:
        template = self.frontend.chat_template
        return template if isinstance(template, str) else None  # named templates (a dict) are not read

    def detokenize(self, token_ids: list[int]) -> str:
        return self.frontend.detokenize(token_ids)

    def token_text(self, token_id: int) -> str:
        return self.frontend.token_text(token_id)

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Run blocking frontend work (tokenize, chat template, compile) on the bounded pool."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def close(self) -> None:
        self.frontend.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
