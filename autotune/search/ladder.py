"""The ladder search: which configuration and micro-batch sizes to probe next.

A pure function of what the study holds (every worker's measurements, resumed runs included)
and of the estimator's predictions; it never sees processes or files.

1. Every configuration of the space gets the estimator's prediction: the largest micro-batch
   that fits and the throughput there (:func:`autotune.estimator.plan.plan`).
2. Predictions are calibrated by what was measured: per configuration, the measured peaks
   rescale the predicted ones (one point fixes a ratio, two fit the line), and across
   configurations the median ratio of measured to predicted throughput rescales the rest.
3. The next probe goes to the configuration with the highest calibrated throughput that is
   still open, at the largest micro-batch the calibrated memory model says fits, plus the
   size below it (the probe sweeps both in one process, smaller first).
4. A configuration is closed once its largest fitting size is bracketed (measured ok, and the
   next size measured or inferred OOM) or nothing fits; the search ends when no open
   configuration's calibrated upper bound can beat the best measured by more than the margin.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from autotune.config import TrainConfig
from autotune.estimator.plan import PlanRow
from autotune.study.store import RETRYABLE, Measurement

__all__ = ["Proposal", "propose"]

UPPER_BOUND_MARGIN = 1.05
"""An open configuration is worth a probe while its calibrated prediction exceeds the best
measured throughput divided by this margin (predictions carry a few percent of error)."""
UNCERTAIN = 1.05
"""A size whose calibrated peak is within this factor of the capacity is probed to verify."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """The next probe: one configuration at one or more micro-batch sizes (ascending)."""

    config: TrainConfig
    micro_batch_sizes: tuple[int, ...]
    predicted_tokens_per_second: float
    reason: str


@dataclass
class _Seen:
    ok: dict[int, float]
    """Micro-batch size -> measured peak bytes, for sizes that ran."""
    oom: set[int]
    failed: set[int]
    running: set[int]
    speed: dict[int, float]
    """Micro-batch size -> measured objective."""


def _by_config(measurements: Iterable[Measurement]) -> dict[TrainConfig, _Seen]:
    seen: dict[TrainConfig, _Seen] = defaultdict(lambda: _Seen({}, set(), set(), set(), {}))
    interrupted: dict[tuple[TrainConfig, int], int] = defaultdict(int)
    for m in measurements:
        entry = seen[m.config]
        mbs = m.micro_batch_size
        if m.state == "RUNNING":
            entry.running.add(mbs)
        elif m.state == "FAIL" and m.outcome in RETRYABLE:
            interrupted[m.key] += 1  # Ctrl-C or a dead tuner: retried once
            if interrupted[m.key] > 1:
                entry.failed.add(mbs)
        elif m.outcome == "ok":
            peak = m.attrs.get("peak_reserved_bytes") or m.attrs.get("peak_allocated_bytes")
            entry.ok[mbs] = float(peak or 0)
            if m.feasible and m.value:
                entry.speed[mbs] = m.value
        elif m.outcome == "oom" or (m.state == "COMPLETE" and not m.feasible):
            entry.oom.add(mbs)
        elif m.state == "FAIL":
            entry.failed.add(mbs)
    return seen


def _calibrated_peak(row: PlanRow, seen: _Seen, mbs: int) -> float:
    """Predicted peak at ``mbs``, rescaled by the peaks measured for this configuration."""
    slope = row.memory.activation_bytes_per_sample
    predicted = row.memory.peak_bytes + slope * (mbs - row.micro_batch_size)
    measured = sorted(seen.ok.items())
    if len(measured) >= 2:
        (m1, p1), (m2, p2) = measured[0], measured[-1]
        return p2 + (p2 - p1) / (m2 - m1) * (mbs - m2)
    if len(measured) == 1:
        ((m1, p1),) = measured
        at_m1 = row.memory.peak_bytes + slope * (m1 - row.micro_batch_size)
        return predicted + (p1 - at_m1)
    return predicted


def propose(
    rows: list[PlanRow],
    measurements: Iterable[Measurement],
    sizes: list[int],
) -> Proposal | None:
    """The next probe, or None when the search is done.

    Args:
        rows: The planner's rows for every configuration (predictions at the best size).
        measurements: Every trial of the study.
        sizes: Micro-batch sizes that reach the global batch exactly, ascending.

    Returns:
        What to probe next; None when no open configuration can beat the best measured.
    """
    seen = _by_config(measurements)
    ratios = [
        max(s.speed.values()) / row.tokens_per_second
        for row in rows
        if (s := seen.get(row.config)) and s.speed and row.tokens_per_second > 0
    ]
    scale = statistics.median(ratios) if ratios else 1.0
    best = max((max(s.speed.values()) for s in seen.values() if s.speed), default=0.0)
    candidates: list[tuple[float, Proposal]] = []
    for row in rows:
        s = seen.get(row.config) or _Seen({}, set(), set(), set(), {})
        if s.running or s.failed:
            continue  # in flight elsewhere, or broken: not retried by the search
        capacity = row.capacity_bytes
        fits = [m for m in sizes if _calibrated_peak(row, s, m) <= capacity]
        smallest_oom = min(s.oom, default=None)
        if smallest_oom is not None:
            fits = [m for m in fits if m < smallest_oom]
        if not fits:
            if not s.ok and sizes[0] not in s.oom and row.fits:
                fits = [sizes[0]]  # the model says it fits: let a probe decide
            else:
                continue
        target = fits[-1]
        index = sizes.index(target)
        probe: list[int] = []
        if target not in s.ok:
            probe.append(target)
            if not s.ok and index > 0:
                probe.append(sizes[index - 1])  # a second point for the line and the speed
        elif index + 1 < len(sizes) and sizes[index + 1] not in s.oom:
            above = sizes[index + 1]
            # Verify the limit only where the calibrated model is unsure (within 5 %).
            if _calibrated_peak(row, s, above) <= capacity * UNCERTAIN:
                probe.append(above)
        if not probe:
            continue  # the largest fitting size is measured and its limit known
        predicted = row.tokens_per_second * scale
        if best and predicted * UPPER_BOUND_MARGIN < best:
            continue
        candidates.append(
            (
                predicted,
                Proposal(
                    config=row.config,
                    micro_batch_sizes=tuple(sorted(probe)),
                    predicted_tokens_per_second=predicted,
                    reason="calibrated prediction "
                    f"{predicted:,.0f} tokens/s at micro-batch {target}",
                ),
            )
        )
    if not candidates:
        return None
    return max(candidates, key=lambda item: item[0])[1]
