"""`ifb run`: serve an engine over HTTP, or stream one answer with --prompt."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ifb.builder.build import BuildOptions
from ifb.builder.errors import BuildError
from ifb.cli.logging_setup import LOG_FORMATS, LOG_LEVELS, configure_logging
from ifb.cli.option_groups import GroupedCommand
from ifb.runtime.engine_format import DTYPE_ALIASES, ENGINE_JSON, EngineConfig
from ifb.runtime.errors import IfbError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind
from ifb.runtime.runtime_config import RuntimeSettings
from ifb.runtime.step_budget import DEFAULT_TARGET_DECODE_MULTIPLE, DEFAULT_TARGET_FLOOR_MS

if TYPE_CHECKING:
    from ifb.llm import LLM

logger = logging.getLogger(__name__)

API_KEY_ENV = "IFB_API_KEY"
RUN_OPTION_GROUPS = {
    "Model": ("dtype", "max_model_len", "chat_template", "threads"),
    "Limits": ("max_batch_size", "max_num_tokens", "max_queued_requests", "queue_timeout", "default_max_tokens"),
    "Scheduling": ("policy", "chunking", "enable_prefix_reuse", "itl_target_ms", "calibrate"),
    "Server": ("host", "port", "served_model_names", "api_key", "api_key_file", "allowed_origins"),
    "Logging": ("log_level", "log_format", "trace"),
    "One-shot prompt (instead of serving)": ("prompt", "max_tokens", "temperature"),
}


def resolve_api_key(api_key: str | None, api_key_file: Path | None, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key, else --api-key-file (trailing whitespace dropped), else IFB_API_KEY;
    None serves without a key. An empty key is refused rather than silently meaning "no key"."""
    if api_key is not None and api_key_file is not None:
        raise click.UsageError("give --api-key or --api-key-file, not both")
    if api_key is not None:
        key, where = api_key, "--api-key"
    elif api_key_file is not None:
        try:
            key, where = api_key_file.read_text(encoding="utf-8").strip(), f"--api-key-file {api_key_file}"
        except (OSError, UnicodeDecodeError) as error:
            raise click.ClickException(f"cannot read --api-key-file {api_key_file}: {error}") from None
    elif API_KEY_ENV in environ:
        key, where = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    if not key:
        raise click.ClickException(f"the API key from {where} is empty")
    return key


def read_chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise click.ClickException(f"cannot read --chat-template {path}: {error}") from None


def set_compute_threads(threads: int | None) -> None:
    """torch's intra-op threads for this process; OMP_NUM_THREADS too, because libgomp read it
    when torch was imported and only processes started from now on (the spawned builder) see it."""
    if threads is None:
        return
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def check_engine_folder(folder: Path, dtype: str, max_model_len: int | None) -> None:
    """Refuse --dtype / --max-model-len that the engine in `folder` was not built with, naming
    both values and the rebuild command."""
    engine = EngineConfig.load(folder, verify=False)  # LLM verifies the artifacts when it loads them
    wanted_dtype = DTYPE_ALIASES.get(dtype.lower())
    if wanted_dtype is not None and wanted_dtype != engine.dtype:
        overrides: dict[str, Any] = {"dtype": wanted_dtype}
        raise click.ClickException(
            f"--dtype {dtype}: engine {folder} was built with dtype {engine.dtype}, not {wanted_dtype}; "
            f"rebuild with: {engine.rebuild_command(**overrides)}"
        )
    baked = engine.limits.max_seq_len
    if max_model_len is not None and max_model_len > baked:
        raise click.ClickException(
            f"--max-model-len {max_model_len} exceeds engine {folder}'s max_seq_len {baked}; "
            f"rebuild with: {engine.rebuild_command(max_seq_len=max_model_len)}"
        )
    if max_model_len is not None and max_model_len < baked:
        # The runtime takes its sequence limit from the engine and cannot lower it yet.
        raise click.ClickException(
            f"--max-model-len {max_model_len} is below engine {folder}'s max_seq_len {baked}, and a running "
            f"engine cannot lower it; omit --max-model-len, or rebuild with: "
            f"{engine.rebuild_command(max_seq_len=max_model_len)}"
        )


def build_options_for(
    max_batch_size: int | None, max_num_tokens: int | None, dtype: str, max_model_len: int | None
) -> BuildOptions:
    """What to build when TARGET is a SOURCE: at least the defaults, and what the flags ask for."""
    defaults = BuildOptions()
    return BuildOptions(
        max_batch_size=max(max_batch_size or 0, defaults.max_batch_size),
        max_num_tokens=max(max_num_tokens or 0, defaults.max_num_tokens),
        max_seq_len=max_model_len or defaults.max_seq_len,
        dtype=dtype,
    )


def _effective_log_level(ctx: click.Context, log_level: str) -> str:
    """`ifb -v run` still means debug unless --log-level is given explicitly."""
    verbose = ctx.parent is not None and ctx.parent.params.get("verbose", False)
    explicit = ctx.get_parameter_source("log_level") is not click.core.ParameterSource.DEFAULT
    return log_level if explicit or not verbose else "debug"


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


def _serve(llm: LLM, host: str, port: int, log_level: str, **app_options: Any) -> None:
    import uvicorn

    from ifb.runtime.server import create_app

    # Between steps the step loop's Python (sampling, scheduling) and the event loop share the
    # GIL; with the default 5 ms switch interval the step loop could wait up to 5 ms for it
    # per step while the loop streams tokens. 0.5 ms bounds that wait.
    sys.setswitchinterval(0.0005)
    app = create_app(llm, **app_options)
    logger.info("serving %s on http://%s:%d (max_batch_size %d)", llm.model_name, host, port, llm.config.max_batch_size)
    # log_config=None: uvicorn's loggers propagate to the root handler configure_logging set up,
    # so its lines come out in --log-format like everyone else's.
    uvicorn.run(app, host=host, port=port, log_level=log_level, log_config=None)


@click.command(cls=GroupedCommand, option_groups=RUN_OPTION_GROUPS)
@click.argument("target", required=False)
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPE_ALIASES], case_sensitive=False),
    default="auto",
    show_default=True,
    help="With a SOURCE: the dtype to build. With an engine folder: checked against the engine's.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    help="Longest prompt + output in tokens (ifb build's --max-seq-len). With a SOURCE: built in; "
    "with an engine folder: must equal the engine's max_seq_len.",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="A Jinja chat template FILE replacing the tokenizer's own (chat requests and --prompt).",
)
@click.option(
    "--threads", type=click.IntRange(min=1), default=None, help="Compute threads (default: as the environment says)."
)
@click.option(
    "--max-batch-size",
    "--max-num-seqs",
    "max_batch_size",
    type=int,
    default=None,
    help="Seats per step (<= the engine's). Alias: vLLM's --max-num-seqs.",
)
@click.option(
    "--max-num-tokens",
    "--max-num-batched-tokens",
    "max_num_tokens",
    type=int,
    default=None,
    help="Tokens per step (<= the engine's). Alias: vLLM's --max-num-batched-tokens.",
)
@click.option("--max-queued-requests", type=int, default=64, show_default=True)
@click.option("--queue-timeout", type=float, default=None, help="Seconds a request may wait before a 429.")
@click.option("--default-max-tokens", type=int, default=512, show_default=True, help="For requests without max_tokens.")
@click.option(
    "--policy",
    type=click.Choice([p.value for p in CapacityPolicyKind]),
    default="guaranteed_no_evict",
    show_default=True,
)
@click.option("--chunking", type=click.Choice([c.value for c in ChunkingPolicyKind]), default="fcfs", show_default=True)
@click.option(
    "--enable-prefix-reuse/--no-enable-prefix-reuse",
    "--enable-prefix-caching/--no-enable-prefix-caching",
    "enable_prefix_reuse",
    default=True,
    show_default=True,
    help="Reuse the KV blocks of a shared prompt prefix. Alias: vLLM's --enable-prefix-caching.",
)
@click.option(
    "--itl-target-ms",
    type=click.FloatRange(min=0),
    default=None,
    help="Inter-token latency target: each step's prefill chunk is the largest whose predicted step time "
    "(the engine's cost model) stays under it, and at least one block, so streams never stall behind a "
    f"long prompt. Default: {DEFAULT_TARGET_DECODE_MULTIPLE:g}x each step's own predicted decode time, at least "
    f"{DEFAULT_TARGET_FLOOR_MS:g} ms, so the worst gap stays a small multiple of the typical one at any load "
    "(/health shows it); off for an engine without a cost model. 0 = off: every step may take --max-num-tokens.",
)
@click.option(
    "--calibrate",
    is_flag=True,
    default=False,
    help="Re-measure the step cost model on this machine at start (a few seconds) instead of using the one "
    "ifb build recorded in engine.json.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--served-model-name",
    "served_model_names",
    multiple=True,
    help="A model name clients may use (repeatable; the first is reported). Default: the engine's.",
)
@click.option(
    "--api-key",
    default=None,
    help=f"Require Authorization: Bearer KEY on /v1/*. Visible to every user in `ps`: prefer "
    f"--api-key-file or the {API_KEY_ENV} environment variable.",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Read the API key from FILE.",
)
@click.option(
    "--allowed-origins", multiple=True, help="A CORS origin browsers may call from (repeatable; default none)."
)
@click.option("--log-level", type=click.Choice(LOG_LEVELS, case_sensitive=False), default="info", show_default=True)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="json: one object per line.",
)
@click.option("--trace", type=click.Path(path_type=Path), default=None, help="Write a Chrome trace of the steps.")
@click.option("--prompt", default=None, help="Stream one answer to the terminal and exit.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="With --prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="With --prompt.")
@click.pass_context
def run(
    ctx: click.Context,
    target: str | None,
    dtype: str,
    max_model_len: int | None,
    chat_template: Path | None,
    threads: int | None,
    max_batch_size: int | None,
    max_num_tokens: int | None,
    max_queued_requests: int,
    queue_timeout: float | None,
    default_max_tokens: int,
    policy: str,
    chunking: str,
    enable_prefix_reuse: bool,
    itl_target_ms: float | None,
    calibrate: bool,
    host: str,
    port: int,
    served_model_names: tuple[str, ...],
    api_key: str | None,
    api_key_file: Path | None,
    allowed_origins: tuple[str, ...],
    log_level: str,
    log_format: str,
    trace: Path | None,
    prompt: str | None,
    max_tokens: int,
    temperature: float,
) -> None:
    """Serve TARGET (an engine folder, a model SOURCE, or nothing = the bundled SmolLM2).

    A SOURCE reuses a matching engine under engines/ or builds one first.
    """
    log_level = _effective_log_level(ctx, log_level.lower())
    configure_logging(log_level, log_format)
    api_key = resolve_api_key(api_key, api_key_file, os.environ)
    set_compute_threads(threads)
    settings = RuntimeSettings(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_queued_requests=max_queued_requests,
        policy=CapacityPolicyKind(policy),
        chunking=ChunkingPolicyKind(chunking),
        enable_prefix_reuse=enable_prefix_reuse,
        default_max_tokens=default_max_tokens,
        chat_template=read_chat_template(chat_template),
        itl_target_ms=itl_target_ms,
        calibrate=calibrate,
    )
    build_options = build_options_for(max_batch_size, max_num_tokens, dtype, max_model_len)
    llm = _load_llm(target, dtype, max_model_len, settings, build_options)
    recorder = None
    if trace is not None:
        from ifb.runtime.trace import TraceRecorder

        recorder = TraceRecorder.attach(llm.executor)
    try:
        if prompt is not None:
            _stream_prompt(llm, prompt, max_tokens, temperature)
            return
        _serve(
            llm,
            host,
            port,
            log_level,
            api_key=api_key,
            queue_timeout=queue_timeout,
            served_model_names=served_model_names,
            allowed_origins=allowed_origins,
        )
    finally:
        llm.close()
        if recorder is not None and trace is not None:
            recorder.write(trace)


def _load_llm(
    target: str | None, dtype: str, max_model_len: int | None, settings: RuntimeSettings, build_options: BuildOptions
) -> LLM:
    """The LLM for TARGET, after checking an engine folder against --dtype / --max-model-len."""
    from ifb.llm import LLM

    try:
        if target is not None and (Path(target) / ENGINE_JSON).is_file():
            check_engine_folder(Path(target), dtype, max_model_len)
        llm = LLM(target, settings=settings, build_options=build_options)
    except (IfbError, BuildError) as error:
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
