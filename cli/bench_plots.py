"""PNG plots of a benchmark: seat timeline per mode, latency CDFs, tokens and KV over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from ifb.cli.bench_runner import ModeRun

BENCH_EXTRA_HINT = "pip install 'ifb[bench]' (in a checkout: pip install -e '.[bench]')"


def seat_intervals(run: ModeRun) -> list[tuple[int, str, float, float, list[tuple[float, float]]]]:
    """(seat, request_id, first step start, finish, prefill step spans) for each request.

    A request takes the lowest free seat at its first step and frees it when it finishes.
    """
    seats: dict[str, int] = {}
    active: dict[str, int] = {}
    spans: dict[str, list[float]] = {}
    prefill: dict[str, list[tuple[float, float]]] = {}
    free: list[int] = []
    next_seat = 0
    for step in run.steps:
        for request_id in [rid for rid in active if run.finish_times.get(rid, float("inf")) <= step.start]:
            free.append(active.pop(request_id))
        free.sort()
        for request_id in step.request_ids:
            if request_id not in seats:
                if free:
                    seats[request_id] = free.pop(0)
                else:
                    seats[request_id], next_seat = next_seat, next_seat + 1
                active[request_id] = seats[request_id]
                spans[request_id] = [step.start, step.end]
            spans[request_id][1] = step.end
        for request_id in step.prefill_ids:
            prefill.setdefault(request_id, []).append((step.start, step.end))
    return [
        (seat, rid, spans[rid][0], run.finish_times.get(rid, spans[rid][1]), prefill.get(rid, []))
        for rid, seat in seats.items()
    ]


def import_pyplot() -> Any:
    """matplotlib.pyplot drawing off-screen; matplotlib is only in the `bench` extra."""
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException(f"--plot needs matplotlib, which is not installed: {BENCH_EXTRA_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_plots(runs: Sequence[ModeRun], folder: Path) -> list[Path]:
    plt = import_pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "slot_timeline.png", folder / "latency_cdf.png", folder / "steps_over_time.png"]
    colors = plt.get_cmap("tab20")

    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 3.2), squeeze=False, sharex=False)
    for ax, run in zip(axes[0], runs, strict=True):
        t0 = run.steps[0].start if run.steps else 0.0
        for i, (seat, _, begin, end, prefills) in enumerate(seat_intervals(run)):
            ax.broken_barh([(begin - t0, end - begin)], (seat - 0.4, 0.8), color=colors(i % 20), alpha=0.8)
            ax.broken_barh([(a - t0, b - a) for a, b in prefills], (seat - 0.4, 0.8), color="black", alpha=0.6)
        busy = sum(step.num_requests for step in run.steps)
        ax.set_title(f"{run.name}: {run.wall_s:.1f}s, {busy} busy seat-steps", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("batch seat")
        ax.set_ylim(-0.6, max(run.max_batch_size, 1) - 0.4)
    fig.suptitle("Seat timeline (black: prefill chunks)", fontsize=10)
    _save(plt, fig, paths[0])

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for run in runs:
        ttfts = [t.ttft for t in run.timings if t.ttft is not None]
        for ax, values in zip(axes, (ttfts, [x for t in run.timings for x in t.itls]), strict=True):
            ordered = sorted(values)
            if ordered:
                ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=run.name)
    for ax, title in zip(axes, ("time to first token (s)", "inter-token latency (s)"), strict=True):
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests" if "first" in title else "fraction of tokens")
        ax.set_xscale("log")
        ax.legend(fontsize=8)
    _save(plt, fig, paths[1])

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for run in runs:
        if not run.steps:
            continue
        t0 = run.steps[0].start
        xs = [s.start - t0 for s in run.steps]
        axes[0].plot(xs, [s.num_tokens for s in run.steps], label=run.name, linewidth=0.8)
        axes[1].plot(xs, [s.num_used_blocks for s in run.steps], label=run.name, linewidth=0.8)
    axes[0].set_ylabel("tokens per step")
    axes[1].set_ylabel("KV blocks used")
    for ax in axes:
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8)
    _save(plt, fig, paths[2])
    return paths
