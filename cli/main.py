"""The `ifb` command line: build an engine, run it (serve or one-shot prompt), serve replicas on Ray, bench,
and compile the kernel library ahead of builds."""

from __future__ import annotations

import click

from ifb import __version__
from ifb.cli.bench_command import bench
from ifb.cli.build_command import build
from ifb.cli.kernels_command import kernels
from ifb.cli.logging_setup import configure_logging
from ifb.cli.run_command import run
from ifb.cli.serve_command import serve


@click.group()
@click.version_option(__version__, "--version", prog_name="ifb")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def cli(verbose: bool) -> None:
    """ifb: compile a model into an engine with its limits baked in, then serve it."""
    configure_logging("debug" if verbose else "info")  # `ifb run --log-level/--log-format` may replace it


cli.add_command(build)
cli.add_command(run)
cli.add_command(bench)
cli.add_command(serve)
cli.add_command(kernels)

if __name__ == "__main__":
    cli()
