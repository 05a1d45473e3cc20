"""The ladder search: which configuration and micro-batch sizes to probe next.

A pure function of what the study holds (every worker's measurements, resumed runs included)
and of the estimator's predictions; it never sees processes or files. It is a branch and
bound over the configurations of the space, with the estimator as the bound:

1. Every configuration has the estimator's predicted peak memory (linear in the micro-batch)
   and throughput at each size (:func:`autotune.estimator.plan.plan`).
2. Measurements calibrate the predictions. Memory, per configuration: one measured peak fixes
   the offset of the predicted line, two fit the line. Throughput: every measured point's
   measured/predicted ratio feeds the residual model (:mod:`autotune.search.residuals`),
   which learns from the study which knobs share the estimator's error (engine, ZeRO stage,
   offload, checkpointing, their pairs, each configuration, its micro-batch) and predicts
   every point's ratio with a standard deviation: a measured configuration's other sizes
   closely, an unmeasured one by the groups it shares with measured ones, as far as the
   data shows them shared.
3. Memory predictions carry an uncertainty: ``PRIOR_ERROR`` before a configuration is
   measured, ``ONE_POINT_ERROR`` with one measured point, none with two or more of the
   size's class (accumulating, or the whole per-rank batch: ``_Memory.error``). A memory
   prediction may be high or low by its uncertainty: a size fits for sure below the
   capacity, and may fit up to capacity / (1 - uncertainty).
4. The next probe goes to the open configuration with the highest expected throughput at the
   low end of its uncertainty (``Z_RANK`` standard deviations of the residual below its
   mean: of two alike, the better known first): the calibrated throughput at its calibrated
   largest fitting size (or, where none fits, its smallest size that may), times the chance
   that the size fits. One probe sweeps, smallest first: that size, the size below when the
   configuration has no measurement yet (a second point for the memory line), and the sizes
   above it that may still fit within the memory uncertainty (an OOM there is cheap: the
   sizes below it are kept).
5. A configuration is closed once its largest fitting size is bracketed (measured ok, and the
   next size measured or inferred OOM, or certainly out of memory). The branch and bound ends
   when no open configuration's optimistic bound (its prediction times the residual model's
   ratio about ``Z_BOUND`` standard deviations above the mean, widened by :func:`bound_z`
   while few configurations are measured; for a configuration not measured, the residual
   model's quantile ``Z_TAIL``, which allows for outliers as far as the measured ones say;
   at least ``MIN_ERROR`` above it, at any size that may fit) beats the best measured. The
   best measured is taken as the residual model estimates it where that is lower than its
   mean (down to what the noise alone allows): the best of many single measurements is the
   luckiest, and where the repeats showed a large noise one lucky measurement would
   otherwise prune the configurations that beat it.
6. Then the answer is confirmed: the best point is measured ``REPEATS`` times, and so is
   each measured point that may still beat it (the residual model's estimate ``Z_CONFIRM``
   standard deviations up, with the noise the repeats showed; or a mean within
   ``CONFIRM_MARGIN`` of the best), the most promising first, at most ``CONFIRM_POINTS``
   points; a point's speed is the mean of its measurements, and the branch and bound resumes
   if the means reopen it. A point whose re-measurement ran out of memory no longer fits.
   While the best and a rival stay within the noise of each other (``Z_TIE`` standard
   errors, at least ``TIE_MARGIN``), the less measured is measured again, up to
   ``MAX_REPEATS`` times each.
7. Host memory: a configuration whose offloaded states are predicted not to fit the node's
   host memory (:mod:`autotune.estimator.host`) is never probed, and a probe killed by the
   host's OOM killer (``host_oom``) rules out, for the whole study, every configuration not
   yet measured that is predicted to need at least as much host memory as the one killed.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autotune.config import TrainConfig
from autotune.estimator.plan import PlanRow
from autotune.search.residuals import Observation, Residual, ResidualModel
from autotune.space import oom_rules_out
from autotune.study.fingerprint import Objective
from autotune.study.measurement import RETRYABLE, Measurement, pooled

__all__ = [
    "CONFIRM_MARGIN",
    "CONFIRM_POINTS",
    "MIN_ERROR",
    "ONE_POINT_ERROR",
    "PRIOR_ERROR",
    "REPEATS",
    "Proposal",
    "propose",
]

PRIOR_ERROR = 0.10
"""Relative error assumed of an unmeasured configuration's predicted peak memory: the memory
model was within 0.1-1.5 % of most H100 rows, and this leaves room for the allocator and
workspaces of other nodes (docs/estimator.md). (Throughput's prior is the residual model's.)"""
ONE_POINT_ERROR = 0.03
"""Memory error at other sizes of a configuration measured at one size (the slope is
predicted; the offset is measured)."""
MIN_ERROR = 0.03
"""Floor of the throughput bound above a calibrated prediction (a short probe's timing
noise)."""
CONFIRM_MARGIN = MIN_ERROR
"""Points measured within this fraction of the best are re-measured: a single short probe
cannot order them (its timing noise)."""
CONFIRM_POINTS = 3
"""Points re-measured in all at most (the best among them; a point that becomes the best
past the cap is still confirmed)."""
REPEATS = 2
"""Measurements of the best and of each point that may still beat it before the search
ends."""
TIE_MARGIN = CONFIRM_MARGIN / 2
"""The best and a rival, measured ``REPEATS`` times each, closer than this are measured again
(:func:`_tie_break`; wider where the repeats show more noise)."""
MAX_REPEATS = 4
"""Measurements of the best and of a rival tied with it at most (four measurements of a probe
with 10 % noise put a mean within 5 %; each is a probe of the user's budget)."""


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
    """0 for a first measurement; n for the n-th re-measurement of a single point (of
    ``riding`` alone where that is set)."""
    riding: int | None = None
    """A measured size of the configuration re-measured in this probe beside its new sizes:
    the study's best, measured once, confirmed with one start-up fewer than a probe of its
    own (:func:`_ride_along`); its measurement number is ``repeat``."""
    seed: int | None = None
    """The probe's data seed where it is not ``repeat`` (a probe with a riding size: one no
    re-measurement of a single point uses, so no point is sampled twice alike)."""

    def repeats(self) -> dict[int, int]:
        """Each size's re-measurement number (0: its first measurement)."""
        return {m: self.repeat if self.riding in (None, m) else 0 for m in self.micro_batch_sizes}

    @property
    def data_seed(self) -> int:
        """The probe's data seed: an independent sample of each point it re-measures."""
        return self.repeat if self.seed is None else self.seed


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
    values: dict[int, list[float]] = field(default_factory=dict)
    """Micro-batch size -> each measurement ``speed`` pools (their scatter is the noise's)."""
    unconfirmed: set[int] = field(default_factory=set)
    """Sizes whose re-measurement failed for good (not re-measured again)."""
    scattered: set[int] = field(default_factory=set)
    """Sizes whose measurements differ among themselves (more may tell them apart)."""
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
            if m.value and mbs in entry.speed and m.value != entry.speed[mbs]:
                entry.scattered.add(mbs)
            if m.value and mbs in entry.speed and m.state == "COMPLETE":
                entry.values.setdefault(mbs, []).append(m.value)
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
    """A configuration's calibrated memory line and its uncertainty. ``whole``: the size
    trained in one micro-step (the per-rank batch), which keeps no gradients between
    micro-steps: its own line, the planner's offset (``space.oom_rules_out``)."""

    row: PlanRow
    seen: _Seen
    whole: int

    def accumulation(self, mbs: int) -> int:
        """1 for the size trained in one micro-step, 2 (or more) below it."""
        return 1 if mbs >= self.whole else 2

    def alike(self, a: int, b: int) -> bool:
        """Whether two sizes both accumulate, or neither does (one memory line)."""
        return (self.accumulation(a) > 1) == (self.accumulation(b) > 1)

    def peak(self, mbs: int) -> float:
        alike = [(m, p) for m, p in sorted(self.seen.ok.items()) if self.alike(m, mbs)]
        measured = alike or sorted(self.seen.ok.items())
        if len(alike) >= 2:
            (m1, p1), (m2, p2) = measured[0], measured[-1]
            return p2 + (p2 - p1) / (m2 - m1) * (mbs - m2)
        if measured:
            m1, p1 = measured[-1]
            return self.row.peak_at(mbs) + p1 - self.row.peak_at(m1)
        return self.row.peak_at(mbs)

    def ruled_out(self, mbs: int) -> bool:
        """An OOM measured at this size or one that rules it out."""
        return any(oom_rules_out(o, mbs, self.accumulation) for o in self.seen.oom)

    def error(self, mbs: int) -> float:
        """How far :meth:`peak` may be off at ``mbs``: nothing on a line of two measured
        sizes of its class (both accumulating, or both the whole batch), one point's error
        where the line is one measured size moved by the planner's slope (of its class or the
        other's), the prior with nothing measured."""
        alike = sum(1 for m in self.seen.ok if self.alike(m, mbs))
        if alike >= 2:
            return 0.0
        return ONE_POINT_ERROR if self.seen.ok else PRIOR_ERROR

    def fits(self, mbs: int) -> bool:
        """Fits by the calibrated line (measured sizes: as measured)."""
        if mbs in self.seen.ok:
            return mbs not in self.seen.oom
        return not self.ruled_out(mbs) and self.peak(mbs) <= self.row.capacity_bytes

    def chance_to_fit(self, mbs: int) -> float:
        """1 where the calibrated line fits, falling to 0 at the edge of its uncertainty."""
        if self.fits(mbs):
            return 1.0
        if not self.may_fit(mbs) or not self.error(mbs):
            return 0.0
        capacity, edge = self.row.capacity_bytes, self._edge(mbs)
        return max(0.0, (edge - self.peak(mbs)) / (edge - capacity))

    def may_fit(self, mbs: int) -> bool:
        """Fits within the uncertainty of the calibrated line."""
        if mbs in self.seen.ok or self.ruled_out(mbs):
            return self.fits(mbs)
        return self.peak(mbs) <= self._edge(mbs)

    def _edge(self, mbs: int) -> float:
        """The largest predicted peak at ``mbs`` that may still fit: the prediction may be
        high by :meth:`error` of the truth."""
        return self.row.capacity_bytes / (1 - self.error(mbs))


def predictions(row: PlanRow, objective: Objective) -> Mapping[int, float]:
    """The planner's predicted objective of a row at every micro-batch size."""
    return row.speeds if objective is Objective.TOKENS else row.mfus


HOST_ERROR = 0.10
"""Relative error allowed the host model's prediction of a node's host memory: a row predicted
over the node's memory by less is tried once nothing else has fitted (:func:`propose`)."""


def _host_may_fit(row: PlanRow) -> bool:
    """The row's host memory may fit the node within the host model's error."""
    if row.host is None or row.host_capacity_bytes is None:
        return True
    return row.host.node_bytes * (1 - HOST_ERROR) <= row.host_capacity_bytes


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


Z_BOUND = 2.0
"""Standard deviations of the residual model above its mean that bound what an open
configuration may reach, once many configurations are measured (:func:`bound_z` widens it
before): the branch and bound ends when no bound beats the best measured."""
Z_TAIL = 2.5
"""The quantile of the residual model's mixture (:meth:`Residual.tail`) that bounds an
unmeasured configuration which may be an outlier: a chance of 0.6 % to lie above (the
Gaussian bound's 2.3 %, a quarter of it, because of the many configurations a bound prunes
at once it is the outliers' chances that add up)."""
Z_RANK = 1.0
"""Standard deviations below the mean that rank open configurations: of two expected alike,
the better known goes first."""


def bound_z(configurations: int) -> float:
    """``Z_BOUND`` widened as Student's t with one degree of freedom fewer than the measured
    configurations: the residual model's variances are learnt from them, so with few the
    bound allows for variances larger than learnt (4.0 with three measured configurations,
    2.8 with five, 2.3 with ten). The quantile is the Cornish-Fisher expansion of t's in the
    normal one (Abramowitz & Stegun 26.7.5; within 2 % of the exact t from three)."""
    nu = max(1, configurations - 1)
    z = Z_BOUND
    return z + (z**3 + z) / (4 * nu) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)


@dataclass(frozen=True, slots=True)
class _Beliefs:
    """The residual model's belief at every point of the planner's rows, predicted at once
    for a proposal (one product for all of them, not one a configuration), and the noise it
    learnt from the repeats."""

    residuals: Mapping[tuple[TrainConfig, int], Residual]
    noise: float

    @classmethod
    def of(cls, model: ResidualModel, rows: list[PlanRow], objective: Objective) -> _Beliefs:
        points = [(row.config, m) for row in rows for m in predictions(row, objective)]
        return cls(dict(zip(points, model.predict(points), strict=True)), model.noise)

    def at(self, config: TrainConfig, micro_batch_size: int) -> Residual:
        return self.residuals[(config, micro_batch_size)]


def observations(
    rows: list[PlanRow], seen: Mapping[TrainConfig, _Seen], objective: Objective
) -> list[Observation]:
    """Every measured point as the residual model takes it: measured / predicted."""
    found = []
    for row in rows:
        s = seen.get(row.config)
        if s is None:
            continue
        predicted = predictions(row, objective)
        for mbs, value in sorted(s.speed.items()):
            if predicted.get(mbs):
                logs = [math.log(v) for v in s.values.get(mbs, []) if v > 0]
                center = sum(logs) / len(logs) if logs else 0.0
                scatter = sum((v - center) ** 2 for v in logs)
                found.append(
                    Observation(
                        row.config, mbs, value / predicted[mbs], s.runs.get(mbs, 1), scatter
                    )
                )
    return found


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
    model = ResidualModel(observations(rows, seen, objective))
    z_bound = bound_z(len({o.config for o in model.observations}))
    beliefs = _Beliefs.of(model, rows, objective)
    candidates: list[tuple[float, Proposal, _Memory]] = []
    # LoRA (allowed with --allow lora) trains another model: its rows are the last resort,
    # tried once no full fine-tuning configuration is left that may fit and none has fitted.
    standing = _standing(rows, seen, objective, beliefs)
    for lora in (False, True):
        best = max((v for c, v in standing.items() if c.is_lora == lora), default=0.0)
        if lora and (candidates or any(s.speed for c, s in seen.items() if not c.is_lora)):
            break
        chosen = [row for row in rows if row.config.is_lora == lora]
        candidates += _candidates(
            chosen, seen, sizes, objective, beliefs, z_bound, best, host_limit
        )
    fitted = any(seen[r.config].speed for r in rows if r.host_fits and r.config in seen)
    if not candidates and not fitted:
        # No row predicted to fit the host is left and none has fitted: the rows the host
        # model puts within its error of the node's memory are searched (a host OOM rules out
        # every heavier one), rather than no answer at all.
        near = [row for row in rows if not row.host_fits and _host_may_fit(row)]
        best = max(standing.values(), default=0.0)
        candidates = _candidates(
            near, seen, sizes, objective, beliefs, z_bound, best, host_limit, last_resort=True
        )
    if not candidates:
        return _confirm(rows, seen, objective, beliefs, standing)
    _, pick, memory = max(candidates, key=lambda item: item[0])
    return _ride_along(pick, memory, seen)


def _ride_along(proposal: Proposal, memory: _Memory, seen: Mapping[TrainConfig, _Seen]) -> Proposal:
    """``proposal`` with the study's best point added where it is a size of the proposal's
    configuration measured once: the confirmation the search makes before it ends
    (:func:`_confirm`), made in a probe the configuration runs anyway, so it costs a few steps
    instead of a probe's start-up (a 7B model's load and engine set-up). Only where the
    probe still reaches it: below every new size, or on their memory line (a size that fits
    there keeps every smaller one fitting; a probe ends at its first OOM)."""
    points = [(v, c, m) for c, s in seen.items() for m, v in s.speed.items()]
    if not points:
        return proposal
    _, config, mbs = max(points, key=lambda p: p[0])
    s = seen[config]
    new = proposal.micro_batch_sizes
    if (
        config != proposal.config
        or s.runs.get(mbs, 1) != 1
        or mbs in new
        or s.running
        or mbs in s.unconfirmed
        or not (mbs < new[0] or all(memory.alike(mbs, m) for m in new))
    ):
        return proposal
    runs = sum(n for other in seen.values() for n in other.runs.values())
    return dataclasses.replace(
        proposal,
        micro_batch_sizes=tuple(sorted((*new, mbs))),
        reason=f"{proposal.reason}; confirms the best at micro-batch {mbs} in the same probe",
        repeat=1,
        riding=mbs,
        seed=MAX_REPEATS + runs,
    )


def _standing(
    rows: list[PlanRow],
    seen: Mapping[TrainConfig, _Seen],
    objective: Objective,
    beliefs: _Beliefs,
) -> dict[TrainConfig, float]:
    """Each measured configuration's best point as the bound compares against it: the mean of
    its measurements, or the model's estimate where that is lower (down to what the noise
    alone allows, :func:`_low`). The best of many single
    measurements is the luckiest of them; where the repeats show a noise the model weighs a
    point's measurements against what its configuration's groups measured, and a
    configuration that measured high by chance does not prune the others with its luck."""
    standing: dict[TrainConfig, float] = {}
    for row in rows:
        s = seen.get(row.config)
        if s is None or not s.speed:
            continue
        predicted = predictions(row, objective)
        estimates = {m: beliefs.at(row.config, m) for m in s.speed if predicted.get(m)}
        standing[row.config] = max(
            min(v, max(predicted[m] * estimates[m].ratio, _low(v, s.runs[m], beliefs.noise)))
            if m in estimates
            else v
            for m, v in s.speed.items()
        )
    return standing


def _low(mean: float, runs: int, noise: float) -> float:
    """The least a mean of ``runs`` measurements may be worth by the noise alone
    (``Z_CONFIRM`` standard errors below): the model's estimate of a measured point is not
    taken below it (a model whose size curve the other points made stiff would otherwise
    call a well-repeated measurement a fluke)."""
    return mean * math.exp(-Z_CONFIRM * noise / math.sqrt(max(1, runs)))


def _candidates(
    rows: list[PlanRow],
    seen: dict[TrainConfig, _Seen],
    sizes: list[int],
    objective: Objective,
    beliefs: _Beliefs,
    z_bound: float,
    best: float,
    host_limit: float,
    last_resort: bool = False,
) -> list[tuple[float, Proposal, _Memory]]:
    """The open configurations among ``rows`` that may beat ``best``, each with its rank, its
    proposal (see :func:`propose`) and its calibrated memory line; ``last_resort``: rows
    predicted over the node's host memory by less than ``HOST_ERROR`` too."""
    candidates: list[tuple[float, Proposal, _Memory]] = []
    for row in rows:
        s = seen.get(row.config) or _Seen()
        predicted = predictions(row, objective)
        if row.twin is not None and not revived(row, seen.get(row.twin)):
            continue  # left out by the planner, and its twin's prediction still stands
        if s.running or s.failed or not predicted:
            continue  # in flight elsewhere, broken, or out of memory by any margin
        heavy = row.host is not None and row.host.node_bytes >= host_limit
        if not (row.host_fits or (last_resort and _host_may_fit(row))) or (heavy and not s.ok):
            continue  # needs more host memory than the node has, or than a killed probe
        memory = _Memory(row, s, sizes[-1])
        open_sizes = [m for m in sizes if m in predicted and m not in s.ok and memory.may_fit(m)]
        if not open_sizes:
            continue  # every size that may fit is measured: the limit is bracketed
        residual = {m: beliefs.at(row.config, m) for m in sizes if m in predicted}
        bound = max(
            predicted[m]
            * max(
                residual[m].up(z_bound),
                residual[m].tail(Z_TAIL),
                residual[m].ratio * (1 + MIN_ERROR),
            )
            for m in open_sizes
        )
        if best and bound <= best:
            continue  # cannot beat the best measured, even optimistically
        fitting = [m for m in sizes if m in predicted and memory.fits(m)]
        target = fitting[-1] if fitting else open_sizes[0]
        # One probe holds sizes alike in accumulation: the ranks of a probe end at an OOM, and
        # one of a size that accumulates says nothing of the whole batch in one micro-step.
        probe = {m for m in open_sizes if m >= target and memory.alike(m, target)}
        if not probe:  # the limit is measured; a smaller size is predicted faster
            target = max(open_sizes, key=lambda m: predicted[m])
            probe = {target}
        if not s.ok and target in open_sizes:
            below = [
                m
                for m in sizes
                if m < target
                and m in predicted
                and memory.alike(m, target)
                and not memory.ruled_out(m)
            ]
            if below:
                probe.add(below[-1])  # a second point for the memory line and the speed
        # Expected objective: the calibrated prediction there times the chance that it fits
        # (the calibrated peak's error taken as uniform within the memory uncertainty).
        at = residual[target]
        expected = predicted[target] * at.ratio * memory.chance_to_fit(target)
        candidates.append(
            (
                # Ranked by the low end of the calibrated prediction: of two configurations
                # expected alike, the better known goes first, so an untried offload family
                # (the least known) does not win a probe on an optimistic prediction alone.
                expected * math.exp(-Z_RANK * at.sd),
                Proposal(
                    config=row.config,
                    micro_batch_sizes=tuple(sorted(probe)),
                    predicted=expected,
                    reason=f"calibrated prediction {objective.text(expected)} at "
                    f"micro-batch {target} (bound {objective.text(bound)})"
                    + (
                        f"; {row.twin.label()} ran out of memory where predicted to fit"
                        if row.twin is not None
                        else ""
                    )
                    + (
                        "; LoRA: no full fine-tuning configuration is left that may fit"
                        if row.config.is_lora
                        else ""
                    )
                    + (
                        f"; nothing else fits: its host memory ({row.miss}) is within the "
                        f"host model's {HOST_ERROR:.0%}"
                        if last_resort
                        else ""
                    ),
                ),
                memory,
            )
        )
    return candidates


def revived(row: PlanRow, twin: _Seen | None) -> bool:
    """Whether a row the planner left out (its twin without the knob was predicted to fit as
    large a micro-batch) is a candidate again: the twin ran out of memory at a size this row
    is predicted to fit, so the prediction that made the knob pointless was wrong there."""
    if twin is None:
        return False
    return any(m in row.peaks and row.peaks[m] <= row.capacity_bytes for m in twin.oom)


Z_CONFIRM = 1.5
"""Standard deviations of the residual model above its estimate of a measured point (which
weighs its measurements by the noise the repeats showed) within which it may still beat the
best, and is re-measured (:func:`_confirm`)."""

Z_TIE = 1.5
"""Standard errors within which the best two, each measured ``REPEATS`` times, are measured
again; ``TIE_MARGIN`` at least (the same with a probe's 2 % noise)."""


def _within(noise: float, runs: tuple[int, int], z: float, floor: float) -> float:
    """The relative difference two points' means of ``runs`` measurements each may show by
    noise alone: ``z`` standard errors of their difference, at least ``floor``."""
    return max(floor, z * noise * math.sqrt(1 / runs[0] + 1 / runs[1]))


def _confirm(
    rows: list[PlanRow],
    seen: dict[TrainConfig, _Seen],
    objective: Objective,
    beliefs: _Beliefs,
    standing: Mapping[TrainConfig, float],
) -> Proposal | None:
    """A re-measurement of the best or of a point that may still beat it, or None when the
    best stands.

    The best is measured ``REPEATS`` times before the search ends: of many single
    measurements the best is the luckiest, and its repeat is what tells the noise. Then each
    measured point whose true value may still beat the best's (its residual ``Z_CONFIRM``
    standard deviations above the model's estimate, which weighs its measurements by the
    noise the repeats showed; or a mean within ``CONFIRM_MARGIN`` of the best) is measured
    again, the most promising first, until it has ``REPEATS`` measurements; at most
    ``CONFIRM_POINTS`` points are re-measured in all, but whichever point is best is
    confirmed."""
    by_config = {row.config: row for row in rows}
    points = []  # (mean, config, mbs, runs, upper)
    for config, s in seen.items():
        row = by_config.get(config)
        predicted = predictions(row, objective) if row is not None else {}
        residuals = {m: beliefs.at(config, m) for m in s.speed if predicted.get(m)}
        for mbs, speed in s.speed.items():
            upper = predicted[mbs] * residuals[mbs].up(Z_CONFIRM) if mbs in residuals else speed
            points.append((speed, config, mbs, s.runs[mbs], upper))
    if not points:
        return None
    points.sort(key=lambda p: -p[0])
    best = points[0][0]
    least = max(standing.values(), default=best)  # the best as the bound took it
    rivals = [p for p in points[1:] if p[4] > least or p[0] >= best * (1 - CONFIRM_MARGIN)]
    contenders = [points[0], *sorted(rivals, key=lambda p: -p[4])]
    remeasured = sum(runs > 1 for s in seen.values() for runs in s.runs.values())
    for speed, config, mbs, runs, upper in contenders:
        s = seen[config]
        if runs >= REPEATS or s.running or mbs in s.unconfirmed:
            continue
        alone = (config, mbs) == (points[0][1], points[0][2])
        if remeasured >= CONFIRM_POINTS and not alone:
            break  # the cost is bounded; past it the means stand (the best's is confirmed)
        return Proposal(
            config=config,
            micro_batch_sizes=(mbs,),
            predicted=speed,
            reason=(
                f"confirm the best {objective.text(best)}"
                if alone
                else f"re-measure: {objective.text(speed)} may still beat the best "
                f"{objective.text(best)} (up to {objective.text(upper)} within the noise)"
            )
            + f" (measurement {runs + 1} of {REPEATS})",
            repeat=runs,
        )
    tied = [p for p in points[1:] if p[4] > least]
    return _tie_break(
        points[0], [points[1], *tied] if len(points) > 1 else [], seen, objective, beliefs.noise
    )


def _tie_break(
    best: tuple[float, TrainConfig, int, int, float],
    rivals: list[tuple[float, TrainConfig, int, int, float]],
    seen: dict[TrainConfig, _Seen],
    objective: Objective,
    noise: float,
) -> Proposal | None:
    """One more measurement of the best or of a rival while the two, each measured at least
    ``REPEATS`` times, stay within the noise of each other (their means within ``Z_TIE``
    standard errors of their difference, at least ``TIE_MARGIN``; or the rival's residual may
    still beat the best): the less measured of the two first, up to ``MAX_REPEATS`` each. Two
    means of two short probes still differ by a probe's timing noise, enough to order a point
    2-3 % slower first. Points whose repeats all measured the same (a device without timing
    noise) are not measured again."""
    top = best[0]
    for rival in rivals:
        pair = (best, rival)
        margin = _within(noise, (best[3], rival[3]), Z_TIE, TIE_MARGIN)
        close = rival[0] >= top * (1 - margin) or rival is not rivals[0]
        if not close or any(p[3] < REPEATS for p in pair):
            continue
        if not any(p[2] in seen[p[1]].scattered for p in pair):
            continue  # each measured alike every time: more cannot tell them apart
        for speed, config, mbs, runs, _ in sorted(pair, key=lambda p: p[3]):
            s = seen[config]
            if runs < MAX_REPEATS and not s.running and mbs not in s.unconfirmed:
                return Proposal(
                    config=config,
                    micro_batch_sizes=(mbs,),
                    predicted=speed,
                    reason=f"tie-break: {objective.text(rival[0])} and {objective.text(top)} "
                    f"are within the noise after {runs} measurements (measurement "
                    f"{runs + 1} of at most {MAX_REPEATS})",
                    repeat=runs,
                )
    return None
