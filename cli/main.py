"""The `ifb` command line: build an engine, run (serve or one-shot prompt), bench."""

from __future__ import annotations

import logging
import sys

import click

from ifb.cli.bench_command import bench
from ifb.cli.build_command import build
from ifb.cli.run_command import run


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def cli(verbose: bool) -> None:
    """ifb: compile a model into an engine with its limits baked in, then serve it."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


cli.add_command(build)
cli.add_command(run)
cli.add_command(bench)

if __name__ == "__main__":
    cli()
