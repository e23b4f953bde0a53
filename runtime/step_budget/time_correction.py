"""StepTimeCorrection: how far this server's prefill steps run over the cost model, learned online.

The cost model is fitted at build time on steps timed alone; under load the same shapes ran
~20% longer (bench/README.md: with 8 streams and a 100 ms target, chunked steps took 115-125 ms),
because a served step also samples, detokenizes and delivers, and shares the cores with the
server's threads. The budgets divide their target by this ratio, so the chunk they pick is sized
for what a step here really costs. Only steps that carry a prefill chunk are observed: those are
the steps a budget sizes; decode-only steps would pull the ratio toward their own error.
"""

from __future__ import annotations

# Exponential smoothing weight of each new observation: ~10 chunked steps to follow a change of
# load, while one outlier (a GC pause, a page fault storm) moves the ratio by a tenth of its error.
SMOOTHING = 0.1
# A ratio outside these bounds means the model does not describe this machine at all
# (recalibrate: `ifb run --calibrate`); clamping keeps one wild step from stalling prefill.
MIN_RATIO, MAX_RATIO = 0.5, 2.0


class StepTimeCorrection:
    """The smoothed measured/predicted ratio of chunked steps; 1.0 until one is observed."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        self.smoothing = smoothing
        self.ratio = 1.0
        self.num_observed = 0

    def observe(self, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        ratio = min(MAX_RATIO, max(MIN_RATIO, measured_ms / predicted_ms))
        # The first observation replaces the prior outright: 1.0 is a guess, not a measurement.
        self.ratio = ratio if self.num_observed == 0 else self.ratio + self.smoothing * (ratio - self.ratio)
        self.num_observed += 1
