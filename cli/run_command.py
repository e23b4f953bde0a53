"""`ifb run`: serve an engine over HTTP, or stream one answer with --prompt."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from ifb.cli.field_options import field_options, from_params
from ifb.cli.option_groups import GroupedCommand
from ifb.cli.serving_options import (
    SERVING_OPTION_GROUPS,
    engine_folder,
    merge_groups,
    runtime_settings,
    server_settings,
    serving_options,
    setup_logging,
)
from ifb.runtime.errors import IfbError
from ifb.runtime.runtime_config import RouterSettings, RuntimeSettings, ServerSettings
from ifb.runtime.step.engine import set_compute_threads
from ifb.stop_signal import sigterm_exits

if TYPE_CHECKING:
    from ifb.llm import LLM
    from ifb.runtime.server.model_router import ModelRouter

logger = logging.getLogger(__name__)

RUN_OPTION_GROUPS = merge_groups(
    SERVING_OPTION_GROUPS,
    {
        "Model": ("threads",),
        "Several models": ("models_dir", "max_loaded_models", "models_memory_gb", "idle_unload_s"),
        "One-shot prompt (instead of serving)": ("prompt", "max_tokens", "temperature"),
    },
)


def _stream_prompt(llm: LLM, prompt: str, max_tokens: int, temperature: float) -> None:
    from ifb.runtime.sampling_params import SamplingParams

    if llm.frontend.chat_template:  # --chat-template, else the tokenizer's own
        ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
    else:
        ids = llm.tokenize(prompt)
    last = None
    for output in llm.stream(ids, SamplingParams(max_tokens=max_tokens, temperature=temperature)):
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        last = output
    sys.stdout.write("\n")
    if last is not None:
        click.echo(
            f"[{last.finish_reason.value if last.finish_reason else '?'}, {last.num_output_tokens} tokens, "
            f"TTFT {1000 * (last.ttft_s or 0):.0f} ms, {last.e2e_s or 0:.2f} s]",
            err=True,
        )


def _serve(llm: LLM, server: ServerSettings, log_level: str) -> None:
    import uvicorn

    from ifb.runtime.server import create_app

    # Between steps the step loop's Python (sampling, scheduling) and the event loop share the
    # GIL; with the default 5 ms switch interval the step loop could wait up to 5 ms for it
    # per step while the loop streams tokens. 0.5 ms bounds that wait.
    sys.setswitchinterval(0.0005)
    app = create_app(llm, **server.app_options())
    logger.info(
        "serving %s on http://%s:%d (max_batch_size %d)",
        llm.model_name,
        server.host,
        server.port,
        llm.config.max_batch_size,
    )
    # log_config=None: uvicorn's loggers propagate to the root handler configure_logging set up,
    # so its lines come out in --log-format like everyone else's.
    uvicorn.run(app, host=server.host, port=server.port, log_level=log_level, log_config=None)


@click.command(cls=GroupedCommand, option_groups=RUN_OPTION_GROUPS)
@click.argument("targets", nargs=-1)
@serving_options
@field_options(RouterSettings)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="Compute threads (default: as the environment says)."
)
@click.option("--prompt", default=None, help="Stream one answer to the terminal and exit.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="With --prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="With --prompt.")
@click.pass_context
def run(ctx: click.Context, targets: tuple[str, ...], **params: Any) -> None:
    """Serve TARGET (an engine folder, a model SOURCE, or nothing = the bundled SmolLM2).

    A SOURCE reuses a matching engine under engines/ or builds one first. Several TARGETs (or
    --models-dir) are served together, each under its name, loaded on its first request.
    """
    log_level = setup_logging(ctx, params)
    server = server_settings(params)
    set_compute_threads(params["threads"])
    settings = runtime_settings(params)
    if len(targets) > 1 or router_settings(params).in_use:
        _serve_many(make_router(targets, params), server, log_level)
        return
    target = targets[0] if targets else None
    with sigterm_exits():  # so a SIGTERM, like Ctrl-C, closes the LLM and its compile workers
        llm = _load_llm(target, params, settings)
        try:
            if params["prompt"] is not None:
                _stream_prompt(llm, params["prompt"], params["max_tokens"], params["temperature"])
            else:
                llm.start_guided_workers()
                _serve(llm, server, log_level)
        finally:
            llm.close()


def router_settings(params: Mapping[str, Any]) -> RouterSettings:
    try:
        return from_params(RouterSettings, params)
    except IfbError as error:
        raise click.UsageError(str(error)) from None


def make_router(targets: tuple[str, ...], params: Mapping[str, Any]) -> ModelRouter:
    """The app serving several models (the TARGETs and --models-dir's), each loaded on its first
    request with the flags' runtime settings. Cores: the models share this process's one
    --threads setting (runtime/server/model_pool.py says what that means for busy models)."""
    from ifb.cli.many_models import check_many_models, router_app

    check_many_models(targets, params)
    settings, server = runtime_settings(params), server_settings(params)

    def load(target: str) -> LLM:
        llm = _load_llm(target, params, settings)
        llm.start_guided_workers()  # as the one-model server: warm before its first guided request
        return llm

    return router_app(targets, router_settings(params), server, load)


def _serve_many(app: ModelRouter, server: ServerSettings, log_level: str) -> None:
    import uvicorn

    sys.setswitchinterval(0.0005)  # as _serve: the step loops wait less for the GIL
    logger.info("serving on http://%s:%d", server.host, server.port)
    with sigterm_exits():  # the app's lifespan shutdown closes every loaded model
        uvicorn.run(app, host=server.host, port=server.port, log_level=log_level, log_config=None)


def _load_llm(target: str | None, params: Mapping[str, Any], settings: RuntimeSettings) -> LLM:
    """The LLM for TARGET, after checking an engine folder against --dtype / --max-model-len."""
    from ifb.llm import LLM

    engine = engine_folder(target, params)
    try:
        llm = LLM(engine, settings=settings)
    except IfbError as error:
        raise click.ClickException(str(error)) from None
    limits = llm.engine_config.limits
    logger.info(
        "loaded %s from %s (%s, KV cache %s, max_seq_len %d)",
        llm.model_name,
        llm.engine_config.folder,
        llm.engine_config.dtype,
        llm.engine_config.kv_dtype,
        limits.max_seq_len,
    )
    return llm
