"""Which kernel ISA paths a test run exercised, for its summary: a green run on an AVX2-only
machine skips the AVX-512 builds, and must not read as covering them.

A test exercises a path when it passes with a QuantLibrary fixture (built for the path the builder
picks on this CPU, `best_isa`) or is an other-ISA test: parametrized with a QuantIsa, or marked
`@pytest.mark.isa_path("avx2")`, which compiles that path and compares its bits with this one's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest

from ifb.plugins.quant_build import QuantIsa, QuantLibrary, QuantLibraryError, best_isa, cpu_features, isa_features

MARKER = "isa_path"


def this_cpu() -> tuple[QuantIsa | None, frozenset[str], str]:
    """(the path `ifb build` compiles here or None, this CPU's flags, why None)."""
    try:
        features = cpu_features()
    except OSError as error:  # no /proc/cpuinfo (not Linux)
        return None, frozenset(), f"no CPU flags ({error.strerror})"
    try:
        return best_isa(features), features, ""
    except QuantLibraryError as error:
        return None, features, str(error)


def _other_isa(item: pytest.Item) -> QuantIsa | None:
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        return QuantIsa(marker.args[0])
    callspec = getattr(item, "callspec", None)
    values = callspec.params.values() if callspec is not None else ()
    return next((value for value in values if isinstance(value, QuantIsa)), None)


@dataclass(slots=True)
class IsaReport:
    ran: Counter[QuantIsa] = field(default_factory=Counter)
    failed: Counter[QuantIsa] = field(default_factory=Counter)
    skipped: dict[QuantIsa, Counter[str]] = field(default_factory=dict)

    def record(self, item: pytest.Item, report: pytest.TestReport) -> None:
        """One test phase's outcome (pytest_runtest_makereport)."""
        other = _other_isa(item)
        if report.skipped and other is not None:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.setdefault(other, Counter())[reason.removeprefix("Skipped: ")] += 1
        if report.when != "call" or report.skipped:
            return
        paths = {value.isa for value in getattr(item, "funcargs", {}).values() if isinstance(value, QuantLibrary)}
        if other is not None:
            paths.add(other)
        for isa in paths:
            (self.ran if report.passed else self.failed)[isa] += 1

    def lines(self, cpu: tuple[QuantIsa | None, frozenset[str], str] | None = None) -> list[str]:
        """The summary; `cpu` as this_cpu() returns it (default: this machine's)."""
        own, features, why = cpu or this_cpu()
        head = f"ISA paths: this CPU builds {own.value}" if own else f"ISA paths: this CPU builds none ({why})"
        ran = [f"{isa.value} ({n} tests)" for isa, n in self.ran.items()]
        lines = [f"{head}; ran: {', '.join(ran) or 'none (no kernel test ran)'}"]
        if self.failed:
            lines.append("  failed: " + ", ".join(f"{isa.value} ({n} tests)" for isa, n in self.failed.items()))
        not_run = [isa for isa in QuantIsa if isa not in self.ran]
        for isa in not_run:
            reasons = self.skipped.get(isa)
            if reasons:
                why_not = "; ".join(f"{reason} ({n})" for reason, n in reasons.items())
            elif missing := sorted(set(isa_features(isa)) - features):
                why_not = f"no test can run it here: this CPU lacks {', '.join(missing)}"
            else:
                why_not = "no test of it ran in this selection"
            lines.append(f"  skipped: {isa.value}: {why_not}")
        if not_run:
            lines.append(
                "  (this run does not show that the skipped paths give the same bits; run on a CPU that has them)"
            )
        return lines
