"""`ifb kernels`: compile this CPU's kernel library into the compile cache ahead of any build."""

from __future__ import annotations

import time

import click

from ifb.builder.artifact_cache import ArtifactCache
from ifb.builder.compile_cpu import prepare_kernel_library


@click.command()
def kernels() -> None:
    """Compile this CPU's block-quantized kernel library into the compile cache ($IFB_CACHE_DIR, else
    ~/.cache/ifb), unless it holds it already. Every block engine's build needs it and it depends on
    no model, so a first `ifb run FILE.gguf` need not wait for it (~30 s on 2 cores); `make install`
    runs this. An entry that fails its checksum is compiled again."""
    cache = ArtifactCache()
    started = time.monotonic()
    isa, compiled = prepare_kernel_library(cache)
    if compiled:
        click.echo(f"kernel library ({isa.value}): compiled in {time.monotonic() - started:.1f} s into {cache.root}")
    else:
        click.echo(f"kernel library ({isa.value}): already in {cache.root}")
