"""A build's stages reach the serving process, and the router's /health status shows the stage of
a model being built at its first request (ifb/build_progress.py)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from ifb.build_progress import BuildProgress
from ifb.builder.build import BuildOptions
from ifb.find_or_build import build_in_child_process
from ifb.runtime.server.model_pool import ModelLoadError, ModelPool, ModelSpec


def test_the_child_builds_stages_arrive_before_its_error(tmp_path: Path) -> None:
    stages: list[str] = []
    missing = tmp_path / "no-such-model.gguf"
    with pytest.raises(Exception, match="no-such-model"):
        build_in_child_process(str(missing), tmp_path / "engine", BuildOptions(), on_stage=stages.append)
    # the build announced "read" in its spawned process, then failed reading the missing file
    assert stages == ["read"]
    assert not (tmp_path / "engine").exists()


def test_progress_reports_the_current_stage_and_forgets_a_finished_build() -> None:
    now = [100.0]
    progress = BuildProgress(clock=lambda: now[0])
    assert progress.report("a.gguf") is None
    progress.on_stage("a.gguf")("read")
    now[0] = 103.0
    progress.on_stage("a.gguf")("compile")
    now[0] = 110.25
    assert progress.report("a.gguf") == {"stage": "compile", "stage_for_s": 7.2}
    assert progress.report("b.gguf") is None
    progress.finished("a.gguf")
    assert progress.report("a.gguf") is None


def test_a_loading_models_status_names_its_build_stage() -> None:
    loading, release = threading.Event(), threading.Event()

    def load() -> Any:
        loading.set()
        release.wait(timeout=60)
        raise RuntimeError("the build failed")

    spec = ModelSpec("m", load, "m.gguf", progress=lambda: {"stage": "compile", "stage_for_s": 1.0})
    pool = ModelPool([spec], make_app=lambda engine, name: None)

    async def scenario() -> dict[str, Any]:
        acquiring = asyncio.ensure_future(pool.acquire("m"))
        await asyncio.to_thread(loading.wait, 60)
        status = pool.status("m")
        release.set()
        with pytest.raises(ModelLoadError, match="the build failed"):
            await acquiring
        return status

    status = asyncio.run(scenario())
    assert status["state"] == "loading"
    assert status["build"] == {"stage": "compile", "stage_for_s": 1.0}
    assert "build" not in pool.status("m")  # unloaded after the failure: no build shown
