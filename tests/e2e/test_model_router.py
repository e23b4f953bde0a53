"""Several models behind one `ifb run` server (runtime/server/model_router.py): the session's tiny
Llama and tiny Qwen2 engines, served through the app `ifb run` makes for several TARGETs. Each
answers under its name with its own greedy text, /v1/models shows them load and unload, a bound
of one loaded model swaps them, an unknown model is a 404 naming it, and idle models unload."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from server_harness import free_port
from waiting import wait_until

from ifb import LLM
from ifb.cli.many_models import router_app
from ifb.cli.model_needs import target_need
from ifb.cli.run_command import make_router, run
from ifb.runtime.runtime_config import RouterSettings, ServerSettings
from ifb.runtime.sampling_params import SamplingParams
from ifb.runtime.server.model_memory import GB, OVERHEAD_BYTES
from ifb.runtime.server.model_pool import NoRoomError
from ifb.runtime.server.model_router import ModelRouter

LLAMA, QWEN = "tiny-llama-fp32", "tiny-qwen2-fp32"  # the engines' folder names: their served names
PROMPT = "The quick brown fox"
MAX_TOKENS = 12
LOAD_S = 300  # upper bound for loading a tiny engine on a loaded 2-core machine


@pytest.fixture(scope="module")
def alone(tiny_llama_engine: Path, tiny_qwen2_engine: Path) -> dict[str, str]:
    """Each model's greedy text served alone: what the router must give under its name."""
    texts = {}
    for name, engine in ((LLAMA, tiny_llama_engine), (QWEN, tiny_qwen2_engine)):
        with LLM(engine) as llm:
            (output,) = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            texts[name] = output.text
    assert texts[LLAMA] != texts[QWEN]  # else answering under the wrong name would go unseen
    return texts


@contextmanager
def router_server(*args: str) -> Iterator[tuple[str, ModelRouter]]:
    """The router `ifb run ARGS` serves, on a free loopback port (its shutdown closes the models)."""
    targets_and_flags = run.make_context("run", list(args))
    app = make_router(targets_and_flags.params["targets"], targets_and_flags.params)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: httpx.get(base + "/health/live", timeout=5).status_code == 200,
        60,
        "the router to answer /health/live",
        ignoring=(httpx.HTTPError,),
    )
    try:
        yield base, app
    finally:
        server.should_exit = True
        thread.join(LOAD_S)
        assert not thread.is_alive()


def states(base: str) -> dict[str, str]:
    body = httpx.get(base + "/v1/models", timeout=30).json()
    assert body["object"] == "list"
    return {card["id"]: card["status"] for card in body["data"]}


def complete(base: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    return httpx.post(base + "/v1/completions", json=body, timeout=LOAD_S)


def completion_text(base: str, model: str) -> str:
    response = complete(base, model)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return str(response.json()["choices"][0]["text"])


def test_two_models_answer_under_their_names(
    tiny_llama_engine: Path, tiny_qwen2_engine: Path, alone: dict[str, str]
) -> None:
    with router_server(str(tiny_llama_engine), str(tiny_qwen2_engine)) as (base, _):
        assert states(base) == {LLAMA: "unloaded", QWEN: "unloaded"}
        assert completion_text(base, LLAMA) == alone[LLAMA]
        assert states(base) == {LLAMA: "loaded", QWEN: "unloaded"}
        assert completion_text(base, QWEN) == alone[QWEN]
        assert states(base) == {LLAMA: "loaded", QWEN: "loaded"}
        chat = {"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = httpx.post(base + "/v1/chat/completions", json=chat, timeout=LOAD_S)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == QWEN
        health = httpx.get(base + "/health", timeout=30)
        assert health.status_code == 200
        assert {name: model["state"] for name, model in health.json()["models"].items()} == states(base)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert f'model="{LLAMA}"' in metrics and f'model="{QWEN}"' in metrics


def test_one_loaded_model_at_a_time_swaps_them(
    tiny_llama_engine: Path, tiny_qwen2_engine: Path, alone: dict[str, str]
) -> None:
    args = (str(tiny_llama_engine), str(tiny_qwen2_engine), "--max-loaded-models", "1")
    with router_server(*args) as (base, router):
        assert completion_text(base, LLAMA) == alone[LLAMA]
        first = router.pool.slots[LLAMA].engine
        assert first is not None
        assert completion_text(base, QWEN) == alone[QWEN]
        assert states(base) == {LLAMA: "unloaded", QWEN: "loaded"}
        wait_until(lambda: not first.health().ok, 60, "the unloaded model's step loop to stop")
        assert completion_text(base, LLAMA) == alone[LLAMA]
        assert states(base) == {LLAMA: "loaded", QWEN: "unloaded"}


def test_an_unknown_or_missing_model_is_a_404_naming_it(tiny_llama_engine: Path, tiny_qwen2_engine: Path) -> None:
    with router_server(str(tiny_llama_engine), str(tiny_qwen2_engine)) as (base, _):
        response = complete(base, "gpt-4o")
        assert response.status_code == 404
        error = response.json()["error"]
        assert "'gpt-4o'" in error["message"] and LLAMA in error["message"] and QWEN in error["message"]
        assert (error["param"], error["code"]) == ("model", "model_not_found")
        missing = httpx.post(base + "/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert missing.status_code == 404 and "names no model" in missing.json()["error"]["message"]
        anthropic = {"model": "claude", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        refused = httpx.post(base + "/v1/messages", json=anthropic, timeout=30)
        assert refused.status_code == 404
        assert refused.json()["type"] == "error" and "'claude'" in refused.json()["error"]["message"]
        assert httpx.get(base + "/v1/models/gpt-4o", timeout=30).status_code == 404
        assert states(base) == {LLAMA: "unloaded", QWEN: "unloaded"}  # nothing loaded for them


def test_an_idle_model_unloads(tiny_llama_engine: Path, tiny_qwen2_engine: Path, alone: dict[str, str]) -> None:
    args = (str(tiny_llama_engine), str(tiny_qwen2_engine), "--idle-unload-s", "0.5")
    with router_server(*args) as (base, router):
        assert completion_text(base, LLAMA) == alone[LLAMA]
        engine = router.pool.slots[LLAMA].engine
        assert engine is not None  # loaded, and then unloaded by the idle timer alone
        wait_until(lambda: states(base)[LLAMA] == "unloaded", 60, "the idle model to unload")
        wait_until(lambda: not engine.health().ok, 60, "its step loop to stop")
        assert completion_text(base, LLAMA) == alone[LLAMA]  # and it loads again on the next request


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-loaded-models", "0"], "--max-loaded-models"),
        (["--idle-unload-s", "0"], "--idle-unload-s (idle_unload_s) must be > 0"),
        (["--models-dir", "/nonexistent-dir"], "--models-dir (models_dir) /nonexistent-dir is not a directory"),
    ],
)
def test_bad_router_flags_are_refused_naming_the_option(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from ifb.cli.main import cli

    result = CliRunner().invoke(cli, ["run", "a", "b", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_models_dir_names_models_by_folder_and_stem(
    tmp_path: Path, tiny_llama_engine: Path, tiny_qwen2_engine: Path
) -> None:
    (tmp_path / "llama").symlink_to(tiny_llama_engine)
    (tmp_path / "qwen").symlink_to(tiny_qwen2_engine)
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "small.gguf").write_bytes(b"")  # named only: nothing loads until a request names it
    context = run.make_context("run", ["--models-dir", str(tmp_path)])
    router = make_router(context.params["targets"], context.params)
    assert router.pool.names == ("llama", "qwen", "small")
    small = router.pool.status("small")  # not built: its need estimated from the file's size (0 bytes here)
    assert (small["memory_bytes"], small["memory_estimated"]) == (OVERHEAD_BYTES, True)
    assert "estimated" in small["memory_detail"]
    assert router.pool.status("llama")["memory_bytes"] == target_need(str(tiny_llama_engine)).bytes


def test_a_model_that_cannot_fit_is_refused_and_one_load_serves_every_waiter(
    tiny_llama_engine: Path, tiny_qwen2_engine: Path
) -> None:
    """With one model loaded and busy (a request in flight), a request for another is refused
    with the reason (the router's 503), nothing unloaded; once it is idle the other loads in its
    place. Two requests arriving for an unloaded model share one load."""
    loads: list[str] = []

    def load(target: str) -> LLM:
        loads.append(Path(target).name)
        return LLM(target)

    targets = (str(tiny_llama_engine), str(tiny_qwen2_engine))
    router = router_app(targets, RouterSettings(max_loaded_models=1), ServerSettings(), load)
    pool = router.pool

    async def scenario() -> None:
        first, second = await asyncio.gather(pool.acquire(LLAMA), pool.acquire(LLAMA))  # both in flight
        assert first is second and loads == [LLAMA]
        pool.release(LLAMA)
        with pytest.raises(NoRoomError, match=f"cannot load model '{QWEN}'.*max_loaded_models.* is 1"):
            await pool.acquire(QWEN)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router") as client:
            body = {"model": QWEN, "prompt": PROMPT, "max_tokens": 2}
            refused = await client.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert "no loaded model is idle to unload" in refused.json()["error"]["message"]
        assert pool.status(LLAMA)["state"] == "loaded" and pool.status(QWEN)["state"] == "unloaded"
        pool.release(LLAMA)  # now idle: the next request for the other model takes its place
        await pool.acquire(QWEN)
        assert (pool.status(LLAMA)["state"], pool.status(QWEN)["state"]) == ("unloaded", "loaded")
        assert loads == [LLAMA, QWEN]
        pool.release(QWEN)
        await pool.close()

    asyncio.run(scenario())


def test_a_memory_budget_unloads_the_least_recently_used_model_and_refuses_what_cannot_fit(
    tiny_llama_engine: Path, tiny_qwen2_engine: Path
) -> None:
    """--models-memory with room for either model but not both: the second model's load unloads
    the idle first one (no --max-loaded-models), a busy first one makes it a 503 naming the budget,
    the need and what is held; a budget below a model's own need refuses it before loading it.
    /v1/models and /health show each model's bytes as engine.json gives them."""
    needs = {LLAMA: target_need(str(tiny_llama_engine)), QWEN: target_need(str(tiny_qwen2_engine))}
    assert not any(need.estimated for need in needs.values())
    budget = max(n.bytes for n in needs.values()) + min(n.bytes for n in needs.values()) // 2
    targets = (str(tiny_llama_engine), str(tiny_qwen2_engine))
    loads: list[str] = []

    def load(target: str) -> LLM:
        loads.append(Path(target).name)
        return LLM(target)

    def served(gb: float) -> ModelRouter:
        return router_app(targets, RouterSettings(models_memory_gb=gb), ServerSettings(), load)

    async def post(router: ModelRouter, model: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router") as client:
            return await client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})

    async def scenario() -> None:
        router = served(budget / GB)
        pool = router.pool
        assert (await post(router, LLAMA)).status_code == 200
        await pool.acquire(LLAMA)  # a request in flight: LLAMA is busy
        refused = await post(router, QWEN)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]["message"]
        assert f"--models-memory (models_memory_gb) {budget / GB:g} GB" in message
        assert f"{needs[QWEN].bytes / GB:.3f} GB" in message and f"{LLAMA} " in message and "(busy)" in message
        assert loads == [LLAMA]
        pool.release(LLAMA)  # idle now: the next request for QWEN unloads it
        assert (await post(router, QWEN)).status_code == 200
        assert (pool.status(LLAMA)["state"], pool.status(QWEN)["state"]) == ("unloaded", "loaded")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=router), base_url="http://router") as client:
            cards = {card["id"]: card for card in (await client.get("/v1/models")).json()["data"]}
            health = (await client.get("/health")).json()
        assert {name: card["memory_bytes"] for name, card in cards.items()} == {n: v.bytes for n, v in needs.items()}
        assert health["models_memory"] == {"budget_bytes": int(budget / GB * GB), "held_bytes": needs[QWEN].bytes}
        await pool.close()

        small = served((needs[LLAMA].bytes - 1) / GB)
        too_big = await post(small, LLAMA)
        assert too_big.status_code == 503 and "does not fit" in too_big.json()["error"]["message"]
        assert "alone" in too_big.json()["error"]["message"] and loads == [LLAMA, QWEN]  # no load tried
        await small.pool.close()

    asyncio.run(scenario())
