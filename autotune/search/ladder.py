"""The ladder search: which configuration and micro-batch sizes to probe next.

A pure function of what the study holds (every worker's measurements, resumed runs included)
and of the estimator's predictions; it never sees processes or files. It is a branch and
bound over the configurations of the space, with the estimator as the bound:

1. Every configuration has the estimator's predicted peak memory (linear in the micro-batch)
   and throughput at each size (:func:`autotune.estimator.plan.plan`).
2. Measurements calibrate the predictions. Memory, per configuration: one measured peak fixes
   the offset of the predicted line, two fit the line. Throughput: a measured configuration's
   own measured/predicted ratio rescales its other sizes; the others are rescaled per
   :func:`family` (engine and offload, whose errors the first GPU run showed to be shared): by
   the family's own ratios, shrunk toward the whole study's median ratio with the weight of
   ``FAMILY_WEIGHT`` configurations, or by the whole's ratio for a family not yet measured.
3. Each prediction carries an uncertainty. Memory: ``PRIOR_ERROR`` before a configuration is
   measured, ``ONE_POINT_ERROR`` with one measured point, none with two or more. Throughput
   of an unmeasured configuration: its family's error (two standard deviations of the
   family's measured/predicted ratios, shrunk toward ``WITHIN_FAMILY_ERROR`` with the weight
   of ``KNOWN_AFTER`` configurations, at least ``MIN_ERROR``, times (1 + 1/sqrt(n)) for the
   error of a scale learnt from n configurations); for a family with no measurement, the
   whole study's error, but above at least up to its uncalibrated prediction times
   (1 + ``PRIOR_ERROR``) (another family's surprise may not be its own), and below at least
   ``OFFLOAD_PRIOR_ERROR`` for offload, which has shown itself slower than predicted, never
   faster; a measured configuration's other sizes: ``MIN_ERROR``. A memory prediction may be
   high or low by its uncertainty: a size fits for sure below the capacity, and may fit up to
   capacity / (1 - uncertainty).
4. The next probe goes to the open configuration with the highest expected throughput at the
   low end of its uncertainty (of two alike, the better known first): the calibrated
   throughput at its calibrated largest fitting size (or, where none fits, its smallest size
   that may), times the chance that the size fits, times (1 - the error below). One probe
   sweeps, smallest first: that size, the size below when the configuration has no
   measurement yet (a second point for the memory line), and the sizes above it that may
   still fit within the memory uncertainty (an OOM there is cheap: the sizes below it are
   kept).
5. A configuration is closed once its largest fitting size is bracketed (measured ok, and the
   next size measured or inferred OOM, or certainly out of memory). The branch and bound ends
   when no open configuration's optimistic bound (calibrated throughput x (1 + the error
   above) at any size that may fit) beats the best measured.
6. Then near-ties are re-measured: one short probe's timing scatters by a few per cent, so
   of the ``CONFIRM_TOP`` best points, those within ``CONFIRM_MARGIN`` of the best are
   measured again until each has ``REPEATS`` measurements (at most ``CONFIRM_TOP`` points
   in all); a point's speed is the mean of its measurements, and the branch and bound
   resumes if the means reopen it. A point whose re-measurement ran out of memory no longer
   fits.
7. Host memory: a configuration whose offloaded states are predicted not to fit the node's
   host memory (:mod:`autotune.estimator.host`) is never probed, and a probe killed by the
   host's OOM killer (``host_oom``) rules out, for the whole study, every configuration not
   yet measured that is predicted to need at least as much host memory as the one killed.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autotune.config import Engine, Offload, TrainConfig
from autotune.estimator.plan import PlanRow
from autotune.study.fingerprint import Objective
from autotune.study.measurement import RETRYABLE, Measurement, pooled

__all__ = [
    "CONFIRM_MARGIN",
    "CONFIRM_TOP",
    "MIN_ERROR",
    "ONE_POINT_ERROR",
    "PRIOR_ERROR",
    "REPEATS",
    "Proposal",
    "propose",
]

PRIOR_ERROR = 0.10
"""Relative error assumed of an unmeasured prediction, memory and time alike: the time model's
agreement with published runs is within 9-15 % (docs/time-model.md), and the memory model's
error on real GPUs (allocator, workspaces) is not yet measured (docs/gpu-results.md)."""
ONE_POINT_ERROR = 0.03
"""Memory error at other sizes of a configuration measured at one size (the slope is
predicted; the offset is measured)."""
MIN_ERROR = 0.03
"""Floor of the throughput uncertainty learnt from measured configurations (timing noise of a
short probe, and what three configurations cannot show)."""
OFFLOAD_PRIOR_ERROR = 0.40
"""How much slower than predicted an offload family may be before one of its configurations
is measured: offload runs at the speed of the node's host CPUs and PCIe links, which vary from
node to node far more than GPUs do (the first H100 run measured DeepSpeed optimizer offload at
0.44-0.76 of its prediction, and the other families within 25 % above theirs)."""
WITHIN_FAMILY_ERROR = 0.05
"""Relative error of a configuration's calibrated prediction from its family's measured ratio,
before the family's own spread is known: on the H100 run the measured/predicted speed of the
configurations of one family agreed within about ±5 % (single across checkpointing, DeepSpeed
optimizer offload across ZeRO stages and checkpointing, docs/time-model.md)."""
FAMILY_WEIGHT = 0.5
"""Weight of the whole study's ratio, in configurations, against a family's own measured ones:
configurations of one family share most of their error. The evidence is the H100 run against
the time model before it was calibrated on that run: DeepSpeed ZeRO-2 and ZeRO-3 optimizer
offload measured 0.56 and 0.60 of their predictions, one family's error shared by its stages;
on another node the calibrated model's error is expected to take the same shape."""
KNOWN_AFTER = 5
"""Weight of the prior throughput error, in measured configurations, against their spread."""
CONFIRM_MARGIN = MIN_ERROR
"""Points measured within this fraction of the best are re-measured: a single short probe
cannot order them (its timing noise)."""
CONFIRM_TOP = 3
"""Near-ties are looked for among this many of the best points, and at most this many points
are re-measured in all."""
REPEATS = 2
"""Measurements of each near-tie before the search ends."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Proposal:
    """The next probe: one configuration at one or more micro-batch sizes (ascending)."""

    config: TrainConfig
    micro_batch_sizes: tuple[int, ...]
    predicted: float
    """The expected objective (tokens/s or MFU, as the study maximizes): the calibrated
    prediction times the chance to fit, or for a re-measurement the mean measured so far."""
    reason: str
    repeat: int = 0
    """0 for a first measurement; n for the n-th re-measurement of a single point."""


@dataclass
class _Seen:
    ok: dict[int, float] = field(default_factory=dict)
    """Micro-batch size -> measured peak bytes (the largest), for sizes that ran."""
    oom: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    running: set[int] = field(default_factory=set)
    speed: dict[int, float] = field(default_factory=dict)
    """Micro-batch size -> mean measured objective, for sizes that fit every time (pooled)."""
    runs: dict[int, int] = field(default_factory=dict)
    """Micro-batch size -> how many measurements ``speed`` pools."""
    unconfirmed: set[int] = field(default_factory=set)
    """Sizes whose re-measurement failed for good (not re-measured again)."""
    host_oom: bool = False
    """A probe of the configuration was killed for want of host memory."""


def _by_config(measurements: list[Measurement]) -> dict[TrainConfig, _Seen]:
    seen: dict[TrainConfig, _Seen] = defaultdict(_Seen)
    for point in pooled(measurements):
        entry = seen[point.config]
        entry.speed[point.micro_batch_size] = point.value or 0.0
        entry.runs[point.micro_batch_size] = point.repeats
    interrupted: dict[tuple[TrainConfig, int, int], int] = defaultdict(int)
    for m in measurements:
        entry = seen[m.config]
        mbs = m.micro_batch_size
        if m.state == "RUNNING":
            entry.running.add(mbs)
        elif m.state == "FAIL" and m.outcome in RETRYABLE:
            interrupted[(*m.key, m.repeat)] += 1  # Ctrl-C or a dead tuner: retried once
            if interrupted[(*m.key, m.repeat)] > 1:
                (entry.unconfirmed if m.repeat else entry.failed).add(mbs)
        elif m.outcome == "ok":
            entry.ok[mbs] = max(entry.ok.get(mbs, 0.0), float(m.peak_bytes or 0))
            if not m.feasible:
                entry.oom.add(mbs)  # ran, but inside the headroom or thrashing: not fitting
        elif m.outcome == "host_oom":
            entry.host_oom = True
        elif m.outcome == "oom" or (m.state == "COMPLETE" and not m.feasible):
            entry.oom.add(mbs)
        elif m.state == "FAIL":
            (entry.unconfirmed if m.repeat else entry.failed).add(mbs)
    return seen


@dataclass(frozen=True, slots=True)
class _Memory:
    """A configuration's calibrated memory line and its uncertainty."""

    row: PlanRow
    seen: _Seen

    def peak(self, mbs: int) -> float:
        measured = sorted(self.seen.ok.items())
        if len(measured) >= 2:
            (m1, p1), (m2, p2) = measured[0], measured[-1]
            return p2 + (p2 - p1) / (m2 - m1) * (mbs - m2)
        if len(measured) == 1:
            ((m1, p1),) = measured
            return self.row.peak_at(mbs) + p1 - self.row.peak_at(m1)
        return self.row.peak_at(mbs)

    @property
    def error(self) -> float:
        points = len(self.seen.ok)
        return 0.0 if points >= 2 else ONE_POINT_ERROR if points == 1 else PRIOR_ERROR

    def fits(self, mbs: int) -> bool:
        """Fits by the calibrated line (measured sizes: as measured)."""
        if mbs in self.seen.ok:
            return mbs not in self.seen.oom
        return (
            mbs < min(self.seen.oom, default=mbs + 1) and self.peak(mbs) <= self.row.capacity_bytes
        )

    def chance_to_fit(self, mbs: int) -> float:
        """1 where the calibrated line fits, falling to 0 at the edge of its uncertainty."""
        if self.fits(mbs):
            return 1.0
        if not self.may_fit(mbs) or not self.error:
            return 0.0
        capacity, edge = self.row.capacity_bytes, self._edge()
        return max(0.0, (edge - self.peak(mbs)) / (edge - capacity))

    def may_fit(self, mbs: int) -> bool:
        """Fits within the uncertainty of the calibrated line."""
        if mbs in self.seen.ok or mbs >= min(self.seen.oom, default=mbs + 1):
            return self.fits(mbs)
        return self.peak(mbs) <= self._edge()

    def _edge(self) -> float:
        """The largest predicted peak that may still fit: the prediction may be high by
        ``error`` of the truth."""
        return self.row.capacity_bytes / (1 - self.error)


def predictions(row: PlanRow, objective: Objective) -> Mapping[int, float]:
    """The planner's predicted objective of a row at every micro-batch size."""
    return row.speeds if objective is Objective.TOKENS else row.mfus


def _host_limit(rows: list[PlanRow], seen: dict[TrainConfig, _Seen]) -> float:
    """The least predicted host memory of a configuration the OOM killer stopped: the host
    model under-predicts at least there, so every configuration predicted to need as much is
    ruled out too (infinite before any host OOM)."""
    killed = [
        row.host.node_bytes
        for row in rows
        if row.host is not None and seen.get(row.config, _Seen()).host_oom
    ]
    return float(min(killed, default=math.inf))


Family = tuple[Engine, Offload]


def family(config: TrainConfig) -> Family:
    """What a configuration's prediction errors are shared with: its engine and offload. The
    first GPU run showed the errors systematic per family (offload rows 1.4-2x optimistic,
    the rest 15-20 % pessimistic), not independent per configuration."""
    return config.engine, config.offload


def _scale(ratios: list[float], prior: float) -> tuple[float, float]:
    """The median of measured/predicted ratios, and the error of applying it elsewhere: about
    two standard deviations of the ratios, shrunk toward ``prior`` by ``KNOWN_AFTER``
    pseudo-observations (a few similar ratios do not prove a small error), times
    (1 + 1/sqrt(n)) for the error of a scale learnt from n configurations."""
    if not ratios:
        return 1.0, prior
    scale = statistics.median(ratios)
    n = len(ratios)
    spread = prior
    if n >= 2:
        observed = 2 * statistics.stdev(r / scale for r in ratios)
        spread = max(MIN_ERROR, (KNOWN_AFTER * prior + n * observed) / (KNOWN_AFTER + n))
    return scale, spread * (1 + 1 / math.sqrt(n))


@dataclass(frozen=True, slots=True)
class _Calibration:
    """How an unmeasured configuration's predicted objective is corrected, and how far the
    truth may lie above (``up``) and below (``down``) the corrected value."""

    ratio: float
    up: float
    down: float


def _throughput_scales(
    rows: list[PlanRow], seen: dict[TrainConfig, _Seen], objective: Objective
) -> dict[Family, _Calibration]:
    """Per family: the ratio that calibrates an unmeasured configuration's prediction, and its
    uncertainty.

    A measured family's own ratios count, shrunk toward the whole study's median ratio by
    ``FAMILY_WEIGHT`` pseudo-configurations, so one family's surprise neither flatters nor
    condemns the others; its error is its own spread (``WITHIN_FAMILY_ERROR`` until two are
    measured). A family with no measurement takes the whole study's ratio and error, but its
    bound is at least its own uncalibrated prediction times (1 + ``PRIOR_ERROR``) (the other
    families' surprise may not be its own), and below it at least ``OFFLOAD_PRIOR_ERROR`` for
    offload: offload has shown itself slower than predicted, never faster.
    """
    ratios: dict[Family, list[float]] = defaultdict(list)
    for row in rows:
        s = seen.get(row.config)
        predicted = predictions(row, objective)
        pairs = [(v, predicted[m]) for m, v in s.speed.items() if predicted.get(m)] if s else []
        if pairs:
            ratios[family(row.config)].append(statistics.mean(v / p for v, p in pairs))
    whole, whole_error = _scale([r for own in ratios.values() for r in own], PRIOR_ERROR)
    scales: dict[Family, _Calibration] = {}
    for key in {family(row.config) for row in rows}:
        offload = key[1] is not Offload.NONE
        own = ratios.get(key, [])
        if not own:
            # Another family's surprise may not be shared: an unmeasured family may still be
            # as fast as its own prediction says, within the prior.
            ceiling = max(whole * (1 + whole_error), 1 + PRIOR_ERROR)
            down = max(whole_error, OFFLOAD_PRIOR_ERROR) if offload else whole_error
            scales[key] = _Calibration(whole, ceiling / whole - 1, down)
            continue
        ratio = (FAMILY_WEIGHT * whole + sum(own)) / (FAMILY_WEIGHT + len(own))
        error = _scale(own, WITHIN_FAMILY_ERROR)[1]
        scales[key] = _Calibration(ratio, error, error)
    return scales


def propose(
    rows: list[PlanRow],
    measurements: Iterable[Measurement],
    sizes: list[int],
    objective: Objective = Objective.TOKENS,
) -> Proposal | None:
    """The next probe, or None when the search is done.

    Args:
        rows: The planner's rows for every configuration (predictions at every size).
        measurements: Every trial of the study.
        sizes: Micro-batch sizes that reach the global batch exactly, ascending.
        objective: What the study maximizes (its trials' values).

    Returns:
        What to probe next; None when no open configuration can beat the best measured.
    """
    seen = _by_config(list(measurements))
    host_limit = _host_limit(rows, seen)
    scales = _throughput_scales(rows, seen, objective)
    best = max((max(s.speed.values()) for s in seen.values() if s.speed), default=0.0)
    candidates: list[tuple[float, Proposal]] = []
    for row in rows:
        s = seen.get(row.config) or _Seen()
        predicted = predictions(row, objective)
        if s.running or s.failed or not predicted:
            continue  # in flight elsewhere, broken, or out of memory by any margin
        heavy = row.host is not None and row.host.node_bytes >= host_limit
        if not row.host_fits or (heavy and not s.ok):
            continue  # needs more host memory than the node has, or than a killed probe
        memory = _Memory(row, s)
        own = [v / predicted[m] for m, v in s.speed.items() if predicted.get(m)]
        calibration = (
            _Calibration(statistics.mean(own), MIN_ERROR, MIN_ERROR)
            if own
            else scales[family(row.config)]
        )
        ratio = calibration.ratio
        open_sizes = [m for m in sizes if m in predicted and m not in s.ok and memory.may_fit(m)]
        if not open_sizes:
            continue  # every size that may fit is measured: the limit is bracketed
        bound = max(predicted[m] for m in open_sizes) * ratio * (1 + calibration.up)
        if best and bound <= best:
            continue  # cannot beat the best measured, even optimistically
        fitting = [m for m in sizes if m in predicted and memory.fits(m)]
        target = fitting[-1] if fitting else open_sizes[0]
        probe = {m for m in open_sizes if m >= target}
        if not probe:  # the limit is measured; a smaller size is predicted faster
            target = max(open_sizes, key=lambda m: predicted[m])
            probe = {target}
        if not s.ok and target in open_sizes:
            below = [m for m in sizes if m < target and m in predicted]
            if below:
                probe.add(below[-1])  # a second point for the memory line and the speed
        # Expected objective: the prediction there times the chance that it fits (the
        # calibrated peak's error taken as uniform within the memory uncertainty).
        expected = predicted[target] * ratio * memory.chance_to_fit(target)
        candidates.append(
            (
                # Ranked by the low end of the calibrated prediction: of two configurations
                # expected alike, the better known goes first, so an untried family (offload
                # the least known) does not win a probe on an optimistic prediction alone.
                expected * (1 - calibration.down),
                Proposal(
                    config=row.config,
                    micro_batch_sizes=tuple(sorted(probe)),
                    predicted=expected,
                    reason=f"calibrated prediction {objective.text(expected)} at "
                    f"micro-batch {target} (bound {objective.text(bound)})",
                ),
            )
        )
    if not candidates:
        return _confirm(seen, objective)
    return max(candidates, key=lambda item: item[0])[1]


def _confirm(seen: dict[TrainConfig, _Seen], objective: Objective) -> Proposal | None:
    """A re-measurement of a near-tie with the best, or None when the best stands."""
    points = sorted(
        (
            (speed, config, mbs, s.runs[mbs])
            for config, s in seen.items()
            for mbs, speed in s.speed.items()
        ),
        key=lambda p: -p[0],
    )[:CONFIRM_TOP]
    if len(points) < 2:
        return None
    best = points[0][0]
    close = [p for p in points if p[0] >= best * (1 - CONFIRM_MARGIN)]
    if len(close) < 2:
        return None  # the best is ahead of the rest by more than the noise
    remeasured = sum(runs > 1 for s in seen.values() for runs in s.runs.values())
    if remeasured >= CONFIRM_TOP:
        return None  # the cost is bounded; the means stand
    for speed, config, mbs, runs in close:
        s = seen[config]
        if runs < REPEATS and not s.running and mbs not in s.unconfirmed:
            return Proposal(
                config=config,
                micro_batch_sizes=(mbs,),
                predicted=speed,
                reason=f"re-measure: {objective.text(speed)} is within {CONFIRM_MARGIN:.0%} "
                f"of the best {objective.text(best)} (measurement {runs + 1} of {REPEATS})",
                repeat=runs,
            )
    return None
