"""`ifb build`: compile a model source into an engine folder, with progress and a summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from tqdm import tqdm

from ifb.builder.build import BUILD_STAGES, BuildOptions, BuildSummary, build_engine
from ifb.builder.errors import BuildError
from ifb.builder.sources import resolve_source
from ifb.cli.field_options import field_options, from_params
from ifb.find_or_build import DEFAULT_ENGINES_DIR, engine_name

_COST_MODEL_WORDS = {
    "measured": "measured in the calibrate phase (and stored for this machine)",
    "reused": "reused: this machine stored a fit for this shape",
    "pending": "pending: the server serves with a conservative budget and times the engine when idle",
    "none": "none: this machine cannot run the engine",
}


def format_summary(summary: BuildSummary) -> str:
    limits = summary.limits
    stages = ", ".join(
        f"{name} {sec:.1f}s / {summary.stage_peak_bytes.get(name, 0) / 2**30:.2f} GiB"
        for name, sec in summary.stage_seconds.items()
    )
    peak = max(summary.stage_peak_bytes.values(), default=0)
    return "\n".join(
        [
            f"engine        {summary.output}",
            f"model         {summary.model_name} ({summary.dtype}, block layers compute {summary.weight_compute})",
            f"max_batch_size {limits.max_batch_size}   max_num_tokens {limits.max_num_tokens}   "
            f"max_seq_len {limits.max_seq_len}",
            f"KV pool       {limits.num_kv_blocks} blocks x {limits.block_size} tokens = "
            f"{limits.kv_pool_tokens} tokens, {summary.kv_pool_bytes / 2**20:.1f} MiB ({summary.kv_dtype})",
            f"artifacts     {summary.artifact_bytes / 2**20:.1f} MiB",
            f"build time    {summary.seconds:.1f}s, peak memory {peak / 2**30:.2f} GiB",
            f"phases        {stages} (time / peak resident memory)",
            f"cost model    {_COST_MODEL_WORDS.get(summary.cost_model, summary.cost_model)}",
        ]
    )


def run_build(source: str | None, output: Path, options: BuildOptions) -> BuildSummary:
    """Build with a stage progress bar; shared by `ifb build` and `ifb run SOURCE`."""
    with tqdm(total=len(BUILD_STAGES), desc="build", unit="stage", file=click.get_text_stream("stderr")) as bar:

        def on_stage(name: str) -> None:
            if bar.n or name != BUILD_STAGES[0]:
                bar.update(1)
            bar.set_postfix_str(name)

        summary = build_engine(source, output, options, on_stage)
        bar.update(bar.total - bar.n)
    return summary


@click.command()
@click.argument("source", required=False)
@field_options(BuildOptions)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Engine folder.")
def build(source: str | None, output: Path | None, **params: Any) -> None:
    """Compile SOURCE (HF checkpoint folder, GGUF file, or nothing = bundled SmolLM2) into an engine."""
    options = from_params(BuildOptions, params)
    try:
        output = output or DEFAULT_ENGINES_DIR / engine_name(resolve_source(source), options)
        summary = run_build(source, output, options)
    except BuildError as error:
        raise click.ClickException(str(error)) from None
    click.echo(format_summary(summary))
