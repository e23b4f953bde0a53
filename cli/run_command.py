"""`ifb run`: placeholder until the runtime lands."""

from __future__ import annotations

import click


@click.command()
def run() -> None:
    """Serve an engine."""
    raise click.ClickException("not yet")
