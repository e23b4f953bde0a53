"""GroupedCommand: a click command whose --help lists its options under headings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import click

OTHER_HEADING = "Other options"


class GroupedCommand(click.Command):
    """`option_groups` maps a heading to option names, in display order; options not named there
    (--help, or one somebody forgot to file) are listed last under "Other options", so no flag
    ever disappears from --help."""

    def __init__(self, *args: Any, option_groups: Mapping[str, Sequence[str]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.option_groups = option_groups

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        records = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):  # arguments: the docstring describes them
                continue
            record = param.get_help_record(ctx)
            if record is not None and param.name is not None:
                records[param.name] = record
        grouped = {name for names in self.option_groups.values() for name in names}
        sections = [
            (heading, [records[n] for n in names if n in records]) for heading, names in self.option_groups.items()
        ]
        sections.append((OTHER_HEADING, [record for name, record in records.items() if name not in grouped]))
        for heading, rows in sections:
            if rows:
                with formatter.section(heading):
                    formatter.write_dl(rows)
