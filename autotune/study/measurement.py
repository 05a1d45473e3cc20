"""A trial of the study, decoded: the typed record every reader of the study works with.

Pure and light (no Optuna, no SQLAlchemy): the store decodes Optuna's trials into
:class:`Measurement`, the read-only reader (:mod:`autotune.study.reader`) decodes the same
rows straight from the database, and the search, the reports and ``autotune best`` consume
them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from autotune.config import Engine, LossDtype, TrainConfig
from autotune.space import JobEngine, Workload
from autotune.study.fingerprint import Fingerprint

__all__ = [
    "MEASURED",
    "OTHER_ENGINE",
    "POOLED_ATTRS",
    "RETRYABLE",
    "Measurement",
    "Point",
    "Pooled",
    "StoredTrial",
    "StudyResult",
    "best_group",
    "best_point",
    "decode",
    "point",
    "pool",
    "pooled",
]

RETRYABLE = ("interrupted", "stale", "not_run")
"""Outcomes of trials that failed through no fault of their configuration (Ctrl-C, a tuner
that died, a size its probe stopped before: the ranks of a probe end at an OOM, and an OOM
of a size that accumulates does not rule out the whole per-rank batch): the search retries
such a point once."""

OTHER_ENGINE = "other_engine"
"""The outcome of a probe of a user's job that trained under another engine than the one
asked (its ``trained_engine`` and ``trained_zero_stage`` say which): no measurement of the
configuration, but what the search learns the engines the job trains under from
(:func:`measured_engines`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One trial, decoded: a configuration at a micro-batch size, and what became of it.

    Speeds are at the user's global batch (the probe's own accumulation count is converted
    when the trial is recorded). A pooled measurement (:func:`pooled`) holds the mean of a
    point's ``repeats`` measurements.
    """

    number: int
    config: TrainConfig
    micro_batch_size: int
    state: str
    """Optuna's trial state: ``COMPLETE``, ``FAIL``, ``RUNNING``, ``PRUNED``."""
    outcome: str | None
    """The probe's outcome for this size (``ok``, ``oom``, ...), ``interrupted`` or ``stale``
    for a point cut short through no fault of its own; None while running."""
    feasible: bool
    value: float | None
    """The study's objective; None unless the trial completed."""
    repeat: int = 0
    """0 for a point's first measurement, n for its n-th re-measurement."""
    repeats: int = 1
    """Measurements averaged into this one (see :func:`pooled`)."""
    tokens_per_second: float | None = None
    """All ranks together, at the user's global batch."""
    mfu: float | None = None
    """Model FLOPs utilization at the user's global batch; None without a peak FLOP/s."""
    grad_accum: int | None = None
    """Micro-steps per optimizer step at the user's global batch."""
    peak_bytes: int | None = None
    """The measured peak that decided the fit (reserved, else allocated)."""
    probe_dir: str | None = None
    message: str | None = None
    simulated: bool = False
    attrs: Mapping[str, Any] = field(default_factory=dict)
    """Every user attribute of the trial as stored (what ``--json`` exports)."""

    @property
    def key(self) -> tuple[TrainConfig, int]:
        return self.config, self.micro_batch_size

    def to_dict(self) -> dict[str, Any]:
        """The JSON form ``autotune best`` and ``autotune trials`` print."""
        return {
            "number": self.number,
            "config": self.config.to_dict(),
            "label": self.config.label(),
            "micro_batch_size": self.micro_batch_size,
            "repeat": self.repeat,
            "repeats": self.repeats,
            "grad_accum": self.grad_accum,
            "state": self.state,
            "outcome": self.outcome,
            "feasible": self.feasible,
            "objective": self.value,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "peak_bytes": self.peak_bytes,
            "probe_dir": self.probe_dir,
            "message": self.message,
            "simulated": self.simulated,
        }


class Pooled(Protocol):
    """What pooling reads of a trial: a :class:`Measurement`, or a lighter :class:`Point`."""

    @property
    def number(self) -> int: ...
    @property
    def key(self) -> tuple[TrainConfig, int]: ...
    @property
    def state(self) -> str: ...
    @property
    def feasible(self) -> bool: ...
    @property
    def value(self) -> float | None: ...
    @property
    def tokens_per_second(self) -> float | None: ...
    @property
    def mfu(self) -> float | None: ...


P = TypeVar("P", bound=Pooled)


class Point(NamedTuple):
    """A trial as pooling reads it (:func:`point`): a fraction of a :class:`Measurement`'s
    cost to decode, for finding the best point among thousands of trials."""

    number: int
    key: tuple[TrainConfig, int]
    state: str
    feasible: bool
    value: float | None
    tokens_per_second: float | None
    mfu: float | None


MEASURED = "measured"
"""The user attribute of a trial's own measurement of the objective (tokens/s or MFU). Optuna's
value of the trial is its point's standing (:func:`standings`), rewritten as repeats come in;
a trial stored without this attribute has its measurement as its value."""

POOLED_ATTRS = ("objective_tokens_per_second", "objective_mfu", MEASURED)
"""The user attributes pooling reads (besides state, params, constraints and value)."""


def pooled(measurements: Iterable[Measurement]) -> list[Measurement]:
    """One measurement per feasible point: the mean of its repeats.

    A point counts only if every completed measurement of it was feasible (a repeat that ran
    out of memory makes the point unreliable). The result is the point's latest measurement
    with the objective, tokens/s and MFU averaged, and ``repeats`` saying how many.
    """
    return [pool(group, _latest(group)) for group in _points(measurements)]


def _points(measurements: Iterable[P]) -> list[list[P]]:
    """The completed measurements of each feasible point, in the order the points appear."""
    groups: dict[tuple[TrainConfig, int], list[P]] = {}
    for m in measurements:
        if m.state == "COMPLETE":
            groups.setdefault(m.key, []).append(m)
    return [group for group in groups.values() if all(m.feasible and m.value for m in group)]


def _latest(group: list[P]) -> P:
    return max(group, key=lambda m: m.number)


def pool(group: Sequence[Pooled], latest: Measurement) -> Measurement:
    """One point's completed measurements as one: ``latest``, the group's highest-numbered
    trial decoded in full, with the objective, tokens/s and MFU averaged over the group and
    ``repeats`` saying how many."""
    tokens = _mean([m.tokens_per_second for m in group])
    mfu = _mean([m.mfu for m in group])
    return dataclasses.replace(
        latest,
        value=_mean([m.value for m in group]),
        tokens_per_second=tokens,
        mfu=mfu,
        repeats=len(group),
        # The stored attributes as the JSON export shows them: pooled too.
        attrs={
            **latest.attrs,
            "objective_tokens_per_second": tokens,
            "objective_mfu": mfu,
            "repeats": len(group),
        },
    )


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def best_group(measurements: Iterable[P]) -> list[P] | None:
    """The completed measurements of the best point (see :func:`best_point`), if any; its
    latest is the highest-numbered."""
    return max(
        _points(measurements),
        key=lambda group: (not group[0].key[0].is_lora, _mean([m.value for m in group]) or 0.0),
        default=None,
    )


def best_point(measurements: Iterable[Measurement]) -> Measurement | None:
    """The feasible point with the highest objective (the mean of its repeats), if any; a
    full fine-tuning point before any LoRA one (LoRA trains another model: the best only
    where nothing else fits)."""
    group = best_group(measurements)
    return None if group is None else pool(group, _latest(group))


@functools.lru_cache(maxsize=1024)
def _config(items: tuple[tuple[str, Any], ...]) -> TrainConfig:
    """A configuration from its stored params. A study holds a few dozen configurations over
    thousands of trials; a configuration is immutable, so one object serves all its trials."""
    return TrainConfig.from_dict(dict(items))


def _key(params: Mapping[str, Any]) -> tuple[TrainConfig, int]:
    """A trial's configuration and micro-batch size, from its params."""
    config = tuple(sorted((k, v) for k, v in params.items() if k != "micro_batch_size"))
    return _config(config), int(params["micro_batch_size"])


@dataclass(frozen=True, kw_only=True, slots=True)
class StoredTrial:
    """A trial's fields as the storage keeps them: what :func:`decode` and :func:`point` read
    (from Optuna's ``FrozenTrial`` or from its tables)."""

    number: int
    state: str
    """Optuna's state name (``COMPLETE``, ``FAIL``, ...)."""
    params: Mapping[str, Any]
    """In their external form: choices, not indices."""
    user_attrs: Mapping[str, Any]
    constraints: Iterable[float]
    """The trial's constraint values (feasible when all are at most 0)."""
    value: float | None
    """The objective as stored (used only when the trial completed)."""


def _measured(trial: StoredTrial) -> float | None:
    """The objective the trial measured (:data:`MEASURED`; before it, its value)."""
    measured = trial.user_attrs.get(MEASURED)
    return trial.value if measured is None else float(measured)


def standings(measurements: Iterable[Pooled]) -> dict[int, float]:
    """Optuna's value of each completed trial (by number), so that Optuna's own readers
    (``study.best_trial``, optuna-dashboard's best trial, a sort by value) name the point
    :func:`best_point` names, with its value: the mean of its point's measurements, or 0
    where the point is no answer (a repeat of it did not fit; a LoRA point where a full
    fine-tuning one fits). The trials' own measurements stay in :data:`MEASURED`."""
    done = [m for m in measurements if m.state == "COMPLETE"]
    groups = _points(done)
    full = any(not group[0].key[0].is_lora for group in groups)
    values = {m.number: 0.0 for m in done}
    for group in groups:
        if full and group[0].key[0].is_lora:
            continue
        mean = _mean([m.value for m in group]) or 0.0
        values.update((m.number, mean) for m in group)
    return values


def point(trial: StoredTrial) -> Point:
    """A trial as pooling reads it, decoded as :func:`decode` does (of the user attributes
    only ``POOLED_ATTRS`` are read)."""
    complete = trial.state == "COMPLETE"
    return Point(
        number=trial.number,
        key=_key(trial.params),
        state=trial.state,
        feasible=complete and all(c <= 0 for c in trial.constraints),
        value=_measured(trial) if complete else None,
        tokens_per_second=trial.user_attrs.get("objective_tokens_per_second"),
        mfu=trial.user_attrs.get("objective_mfu"),
    )


def decode(trial: StoredTrial) -> Measurement:
    """A trial as a measurement, its user attributes copied."""
    config, micro_batch_size = _key(trial.params)
    # A copy in plain JSON types: the caller's values (lists, nested dicts) are not shared.
    attrs = {
        key: json.loads(json.dumps(v)) if isinstance(v, (list, tuple, dict)) else v
        for key, v in trial.user_attrs.items()
    }
    complete = trial.state == "COMPLETE"
    return Measurement(
        number=trial.number,
        config=config,
        micro_batch_size=micro_batch_size,
        state=trial.state,
        # A trial failed by the storage's heartbeat has no outcome: its tuner went stale.
        outcome=attrs.get("outcome", "stale" if trial.state == "FAIL" else None),
        feasible=complete and all(c <= 0 for c in trial.constraints),
        value=_measured(trial) if complete else None,
        repeat=int(attrs.get("repeat", 0)),
        tokens_per_second=attrs.get("objective_tokens_per_second"),
        mfu=attrs.get("objective_mfu"),
        grad_accum=attrs.get("grad_accum"),
        peak_bytes=attrs.get("peak_reserved_bytes") or attrs.get("peak_allocated_bytes"),
        probe_dir=attrs.get("probe_dir"),
        message=attrs.get("message"),
        simulated=bool(attrs.get("simulated")),
        attrs=attrs,
    )


def parse_time(value: Any) -> dt.datetime | None:
    """A time as a database hands it back: a ``datetime`` (PostgreSQL), ISO text (SQLite), or
    None; text that is not a time is None too."""
    if value is None or isinstance(value, dt.datetime):
        return value
    try:
        return dt.datetime.fromisoformat(str(value))
    except ValueError:
        return None


@dataclass(frozen=True, kw_only=True)
class StudyResult:
    """One study of a trial database: its fingerprint, its trials decoded, and the best."""

    fingerprint: Fingerprint
    measurements: list[Measurement]
    """The study's trials: every one, or only the last few (by number) when read so."""
    trial_count: int
    """How many trials the study holds (withdrawn claims aside), whether ``measurements``
    holds them all or not."""
    best: Measurement | None
    """The feasible point with the highest objective (the mean of its repeats), over every
    trial; None when there is none, or when the study was read without it."""
    updated: dt.datetime | None = None
    """When its newest trial ended (Optuna's ``datetime_complete``, the tuner's local time);
    None when none has."""

    @property
    def study_name(self) -> str:
        return self.fingerprint.study_name

    @classmethod
    def of(
        cls,
        fingerprint: Fingerprint,
        measurements: list[Measurement],
        *,
        last: int | None = None,
        best: bool = True,
        updated: dt.datetime | None = None,
    ) -> StudyResult:
        """From every trial of a study, keeping only its ``last`` trials by number (None:
        all of them, in the order given); ``best``: find the best point (else None)."""
        shown = measurements
        if last is not None:
            shown = sorted(measurements, key=lambda m: m.number)[max(len(measurements) - last, 0) :]
        return cls(
            fingerprint=fingerprint,
            measurements=shown,
            trial_count=len(measurements),
            best=best_point(measurements) if best else None,
            updated=updated,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictionGap:
    """How far measurements were from the estimator's own (uncalibrated) predictions, which
    each trial records: the median measured / predicted over the points that ran."""

    speed_ratio: float | None
    """Measured tokens/s over predicted (above 1: faster than predicted)."""
    memory_ratio: float | None
    """Measured peak bytes over predicted (above 1: more memory than predicted)."""
    points: int
    loss_dtype: LossDtype | None = None
    """The dtype the job's loss took the logits in, where the measurement layer saw it."""

    def text(self) -> str:
        """``tokens/s 0.31x and peak memory 1.24x the estimator's prediction (3 points)``."""
        parts = []
        if self.speed_ratio is not None:
            parts.append(f"tokens/s {self.speed_ratio:.2f}x")
        if self.memory_ratio is not None:
            parts.append(f"peak memory {self.memory_ratio:.2f}x")
        plural = "" if self.points == 1 else "s"
        return f"{' and '.join(parts)} the estimator's prediction ({self.points} point{plural})"

    def loss_note(self) -> str:
        """What the job's loss was seen to do where it is not the stand-in's (fp32), as a
        clause to follow :meth:`text`; empty otherwise."""
        if self.loss_dtype is LossDtype.LOGITS:
            return (
                "; its loss takes the logits in their own dtype, with no fp32 copy (the "
                "predictions count it from then on)"
            )
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "speed_ratio": self.speed_ratio,
            "memory_ratio": self.memory_ratio,
            "points": self.points,
            "loss_dtype": None if self.loss_dtype is None else self.loss_dtype.value,
        }


def measured_loss_dtype(measurements: Iterable[Measurement]) -> LossDtype | None:
    """The dtype a user's job's loss took the logits in, as its newest probe that saw it
    recorded (the layer's ``loss_dtype``); None where none did (autotune's stand-in, a fused
    or compiled loss, a study measured before the layer looked)."""
    seen = [m for m in measurements if isinstance(m.attrs.get("loss_dtype"), str)]
    if not seen:
        return None
    newest = max(seen, key=lambda m: m.number).attrs["loss_dtype"]
    try:
        return LossDtype(newest)
    except ValueError:
        return None  # a dtype a newer layer knows and this version does not


_ENGINE_CHOICES = (
    JobEngine(Engine.SINGLE),
    JobEngine(Engine.DDP),
    JobEngine(Engine.FSDP),
    *(JobEngine(Engine.DEEPSPEED, stage) for stage in (1, 2, 3)),
)
"""Every engine the space asks a job for, DeepSpeed once per ZeRO stage it searches."""


def measured_engines(
    measurements: Iterable[Measurement], world_size: int
) -> tuple[JobEngine, ...] | None:
    """The engines a user's job trains under when asked, from its probes on ``world_size``
    ranks: None until one trained under another engine than it asked for
    (:data:`OTHER_ENGINE`).

    A job not seen training as asked under an engine other than those it trained when asked
    otherwise takes its engine from itself (a script that always wraps its model in FSDP2,
    a Trainer whose arguments name no DeepSpeed config): it trains under the engines it was
    seen under, whatever is asked. A job seen training as asked under another engine too
    (its ``ok`` probes) follows the ask for some engines:
    an asked engine it trained another under is left out (DeepSpeed at that stage alone
    where it trained DeepSpeed as asked at another), and where it trained DeepSpeed at a
    ZeRO stage of its own, DeepSpeed is kept to the stages it was seen at."""
    measurements = list(measurements)

    def trained(m: Measurement) -> JobEngine | None:
        try:
            return JobEngine.of(m.attrs["trained_engine"], m.attrs.get("trained_zero_stage"))
        except (KeyError, ValueError, TypeError):
            return None  # none recorded, or an engine a newer layer knows and this one not

    def asked(m: Measurement) -> JobEngine:
        return JobEngine.of(m.config.engine, m.config.zero_stage)

    other = [
        (asked(m), got)
        for m in measurements
        if m.outcome == OTHER_ENGINE and (got := trained(m)) is not None
    ]
    if not other:
        return None
    seen = [got for _, got in other]
    # Engines trained as asked, other than those the job trains when asked otherwise.
    followed = [
        engine
        for engine in (asked(m) for m in measurements if m.outcome == "ok" and trained(m))
        if not any(engine.alike(got, world_size) for got in seen)
    ]
    if not followed:
        return tuple(dict.fromkeys(seen))
    # Several ranks: one process is no choice (each would train alone).
    kept = [e for e in _ENGINE_CHOICES if world_size == 1 or e.engine is not Engine.SINGLE]
    for ask, got in other:
        if got.engine is ask.engine:
            # DeepSpeed at a stage of the job's own: the stages it was seen at.
            stages = [got, *(e for e in followed if e.engine is got.engine)]
            kept = [e for e in kept if e.engine is not got.engine or e in stages]
        elif any(e.engine is ask.engine for e in followed):
            kept = [e for e in kept if not ask.alike(e, world_size)]  # that stage alone
        else:  # the engine itself is not the job's
            kept = [e for e in kept if e.engine is not ask.engine and not ask.alike(e, world_size)]
    return tuple(kept)


def measured_workload(workload: Workload, measurements: Iterable[Measurement]) -> Workload:
    """``workload`` with what probes of a user's job measured of it: the dtype its loss
    takes the logits in (:func:`measured_loss_dtype`), at one rank the engine it wraps a
    lone rank in (the newest probe's ``trained_engine`` of a one-process or DDP
    configuration), and the engines it trains under when asked (:func:`measured_engines`).
    Equal to ``workload`` for autotune's stand-in, whose probes record none of them."""
    measurements = list(measurements)
    loss_dtype = measured_loss_dtype(measurements) or workload.loss_dtype
    engine = workload.one_rank_engine
    if workload.world_size == 1:
        seen = [
            m
            for m in measurements
            if m.config.engine in (Engine.SINGLE, Engine.DDP)
            and m.attrs.get("trained_engine") in (Engine.SINGLE.value, Engine.DDP.value)
        ]
        if seen:
            engine = Engine(max(seen, key=lambda m: m.number).attrs["trained_engine"])
    engines = measured_engines(measurements, workload.world_size)
    if engines is None:
        engines = workload.job_engines
    return dataclasses.replace(
        workload, loss_dtype=loss_dtype, one_rank_engine=engine, job_engines=engines
    )


def prediction_gap(measurements: Iterable[Measurement]) -> PredictionGap | None:
    """The gap between the points that ran and the estimator's predictions recorded with
    them (``estimate_tokens_per_second``, ``estimate_peak_bytes``), or None without any."""
    measurements = list(measurements)
    speeds: list[float] = []
    memories: list[float] = []
    count = 0
    for m in measurements:
        if m.outcome != "ok":
            continue
        speed = m.attrs.get("estimate_tokens_per_second")
        peak = m.attrs.get("estimate_peak_bytes")
        counted = False
        if m.tokens_per_second and isinstance(speed, int | float) and speed > 0:
            speeds.append(m.tokens_per_second / speed)
            counted = True
        if m.peak_bytes and isinstance(peak, int | float) and peak > 0:
            memories.append(m.peak_bytes / peak)
            counted = True
        count += counted
    if not count:
        return None
    return PredictionGap(
        speed_ratio=statistics.median(speeds) if speeds else None,
        memory_ratio=statistics.median(memories) if memories else None,
        points=count,
        loss_dtype=measured_loss_dtype(measurements),
    )
