"""`ifb build`: compile a model source into an engine folder, with progress and a summary."""

from __future__ import annotations

from pathlib import Path

import click
from tqdm import tqdm

from ifb.builder.build import (
    BUILD_STAGES,
    COMPUTE_CHOICES,
    KV_DTYPE_CHOICES,
    WEIGHT_CHOICES,
    Backend,
    BuildOptions,
    BuildSummary,
    build_engine,
)
from ifb.builder.errors import BuildError
from ifb.builder.sources import resolve_source
from ifb.find_or_build import DEFAULT_ENGINES_DIR, engine_name
from ifb.runtime.engine_format import DTYPE_ALIASES


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
@click.option("--max-batch-size", type=int, default=16, show_default=True)
@click.option("--max-num-tokens", type=int, default=512, show_default=True)
@click.option("--max-seq-len", type=int, default=2048, show_default=True)
@click.option("--kv-blocks", type=int, default=None, help="KV pool size in blocks.")
@click.option("--kv-memory", type=float, default=None, help="KV pool size in GB (instead of --kv-blocks).")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option(
    "--dtype",
    type=click.Choice(["auto", *DTYPE_ALIASES], case_sensitive=False),
    default="auto",
    show_default=True,
    help="Activation/KV dtype (vLLM and TensorRT-LLM spellings: float32/fp32, bfloat16/bf16, float16/fp16). "
    "auto: cpu backend: bf16 where the CPU has bf16 matrix units (AMX/AVX512-BF16), else fp32; "
    "tensorrt backend: bf16 on compute capability >= 8.0, else fp16. fp16 is tensorrt only.",
)
@click.option(
    "--weights",
    type=click.Choice(WEIGHT_CHOICES),
    default="auto",
    show_default=True,
    help="How linear weights are stored: auto keeps the source's precision (a GGUF's Q4_0/Q4_1/Q8_0 blocks, "
    "an HF checkpoint's floats); fp32 dequantizes everything; q8_0/q4_1/q4_0 quantize every linear layer "
    "(round-to-nearest per 32-weight block). Block formats compute with fp32 activations (cpu backend only).",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(KV_DTYPE_CHOICES, case_sensitive=False),
    default="auto",
    show_default=True,
    help="What the paged KV cache stores: auto = the engine's dtype; float16/fp16/half (or bfloat16/bf16) "
    "halves the pool of an fp32 engine, so --kv-memory holds twice the blocks. The step still computes in "
    "its dtype: K/V are rounded when written and read back in fp32 (cpu backend only).",
)
@click.option(
    "--compute",
    type=click.Choice(COMPUTE_CHOICES),
    default="auto",
    show_default=True,
    help="How block-quantized layers multiply: auto = int8 where the engine keeps block weights and this CPU "
    "has integer dot products that pay (AVX2, AVX-512, VNNI: all measured faster), else fp32; int8 = "
    "activations quantized per row and 32-block to int8 and integer dot products, as llama.cpp multiplies "
    "its blocks (~2.7x faster layers at 32 rows; quality cost in bench/README.md); fp32 = fp32 activations "
    "times the exact weights (the fp32 engine's numbers up to summation order). Rows stay batch-invariant "
    "either way.",
)
@click.option("--backend", type=click.Choice([b.value for b in Backend]), default="cpu", show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Engine folder.")
def build(
    source: str | None,
    max_batch_size: int,
    max_num_tokens: int,
    max_seq_len: int,
    kv_blocks: int | None,
    kv_memory: float | None,
    block_size: int,
    dtype: str,
    weights: str,
    kv_dtype: str,
    compute: str,
    backend: str,
    output: Path | None,
) -> None:
    """Compile SOURCE (HF checkpoint folder, GGUF file, or nothing = bundled SmolLM2) into an engine."""
    options = BuildOptions(
        max_batch_size=max_batch_size,
        max_num_tokens=max_num_tokens,
        max_seq_len=max_seq_len,
        block_size=block_size,
        dtype=dtype,
        weights=weights,
        kv_dtype=kv_dtype.lower(),
        compute=compute,
        kv_blocks=kv_blocks,
        kv_memory_gb=kv_memory,
        backend=Backend(backend),
    )
    try:
        output = output or DEFAULT_ENGINES_DIR / engine_name(resolve_source(source), options)
        summary = run_build(source, output, options)
    except BuildError as error:
        raise click.ClickException(str(error)) from None
    click.echo(format_summary(summary))
