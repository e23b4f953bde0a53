"""`ifb run`: serve an engine over HTTP, or stream one answer with --prompt."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from ifb.builder.build import BuildOptions
from ifb.builder.errors import BuildError
from ifb.runtime.errors import IfbError
from ifb.runtime.policies import CapacityPolicyKind, ChunkingPolicyKind

logger = logging.getLogger(__name__)


def _stream_prompt(llm: object, prompt: str, max_tokens: int, temperature: float) -> None:
    from ifb.runtime.llm import LLM
    from ifb.runtime.sampling_params import SamplingParams

    assert isinstance(llm, LLM)
    if llm.tokenizer.chat_template:
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


@click.command()
@click.argument("target", required=False)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-batch-size", type=int, default=None, help="Seats per step (<= the engine's).")
@click.option("--max-num-tokens", type=int, default=None, help="Tokens per step (<= the engine's).")
@click.option("--max-queued-requests", type=int, default=64, show_default=True)
@click.option("--queue-timeout", type=float, default=None, help="Seconds a request may wait before a 429.")
@click.option(
    "--policy",
    type=click.Choice([p.value for p in CapacityPolicyKind]),
    default="guaranteed_no_evict",
    show_default=True,
)
@click.option("--chunking", type=click.Choice([c.value for c in ChunkingPolicyKind]), default="fcfs", show_default=True)
@click.option("--enable-prefix-reuse/--no-enable-prefix-reuse", default=True, show_default=True)
@click.option("--default-max-tokens", type=int, default=512, show_default=True, help="For requests without max_tokens.")
@click.option("--api-key", default=None, help="Require Authorization: Bearer KEY on /v1/*.")
@click.option("--prompt", default=None, help="Stream one answer to the terminal and exit.")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="With --prompt.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="With --prompt.")
@click.option("--trace", type=click.Path(path_type=Path), default=None, help="Write a Chrome trace of the steps.")
def run(
    target: str | None,
    host: str,
    port: int,
    max_batch_size: int | None,
    max_num_tokens: int | None,
    max_queued_requests: int,
    queue_timeout: float | None,
    policy: str,
    chunking: str,
    enable_prefix_reuse: bool,
    default_max_tokens: int,
    api_key: str | None,
    prompt: str | None,
    max_tokens: int,
    temperature: float,
    trace: Path | None,
) -> None:
    """Serve TARGET (an engine folder, a model SOURCE, or nothing = the bundled SmolLM2).

    A SOURCE reuses a matching engine under engines/ or builds one first.
    """
    from ifb.llm import LLM

    defaults = BuildOptions()
    build_options = BuildOptions(
        max_batch_size=max(max_batch_size or 0, defaults.max_batch_size),
        max_num_tokens=max(max_num_tokens or 0, defaults.max_num_tokens),
    )
    try:
        llm = LLM(
            target,
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_queued_requests=max_queued_requests,
            policy=policy,
            chunking=chunking,
            enable_prefix_reuse=enable_prefix_reuse,
            default_max_tokens=default_max_tokens,
            build_options=build_options,
        )
    except (IfbError, BuildError) as error:
        raise click.ClickException(str(error)) from None
    recorder = None
    if trace is not None:
        from ifb.runtime.trace import TraceRecorder

        recorder = TraceRecorder.attach(llm.executor)
    try:
        if prompt is not None:
            _stream_prompt(llm, prompt, max_tokens, temperature)
            return
        import uvicorn

        from ifb.runtime.server import create_app

        # Between steps the step loop's Python (sampling, scheduling) and the event loop share the
        # GIL; with the default 5 ms switch interval the step loop could wait up to 5 ms for it
        # per step while the loop streams tokens. 0.5 ms bounds that wait.
        sys.setswitchinterval(0.0005)
        app = create_app(llm, api_key=api_key, queue_timeout=queue_timeout)
        logger.info(
            "serving %s on http://%s:%d (max_batch_size %d)", llm.model_name, host, port, llm.config.max_batch_size
        )
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        llm.close()
        if recorder is not None and trace is not None:
            recorder.write(trace)
