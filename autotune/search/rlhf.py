"""The search over an RL iteration's layouts: real probes, OOMs as evidence, until the fastest
layout that fits is known.

:func:`propose` is pure: from the planner's rows (one per layout: trainer configuration,
engine share, sleep, each at its best micro-batch) and what the study holds, the next layout
to probe, or None when nothing left can beat the best measured. A layout is a candidate while
it may fit: each phase within the device once its trainer's part is allowed the memory
model's prior error (:data:`autotune.search.ladder.PRIOR_ERROR`; the engine's share is exact).
Candidates go fastest first, and, equally fast, the larger share first (the plan's order).
A layout that ran out of memory rules out the same layout at a larger share. The search stops
when the best measured speed reaches the next candidate's prediction scaled by how the
measured speeds compare with their predictions.

Where the engine is emulated (no vLLM in a probe), an iteration's speed counts the probe's
measured scoring and training and the predicted rollout and switch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from autotune.estimator.rlhf import RLHFRow
from autotune.probe.outcome import tally
from autotune.search.ladder import PRIOR_ERROR
from autotune.study.rlhf import RLHFTrial, layout_key

__all__ = ["RLHFSummary", "may_fit", "measured_speed", "propose"]

_SAME = 1e-9
"""Relative difference below which a candidate's bound counts as equal to the best."""


def may_fit(row: RLHFRow, error: float = PRIOR_ERROR) -> bool:
    """Whether ``row`` may fit once its trainer's memory is allowed ``error`` (the engine's
    share is exact)."""
    if not row.engine.starts:
        return False
    for phase, used in row.phases.items():
        engine = row.parts[phase].get("engine", 0)
        if engine + (used - engine) * (1.0 - error) > row.capacity_bytes:
            return False
    return True


def _ruled_out(row: RLHFRow, trials: Sequence[RLHFTrial]) -> bool:
    """A layout whose share is at least that of the same layout that ran out of memory."""
    return any(
        t.outcome == "oom"
        and t.config == row.config
        and t.sleep == row.sleep
        and t.frozen == row.frozen
        and t.micro_batch_size <= row.micro_batch_size
        and t.share <= row.share
        for t in trials
    )


def calibration(rows: Sequence[RLHFRow], trials: Sequence[RLHFTrial]) -> float:
    """How measured speeds compare with their predictions: the largest ratio seen (1 before
    any), so a candidate's bound errs high."""
    predicted = {layout_key(r): r.speed for r in rows}
    ratios = [
        t.samples_per_second / predicted[t.key()]
        for t in trials
        if t.feasible and predicted.get(t.key())
    ]
    return max(ratios, default=1.0)


def propose(rows: Sequence[RLHFRow], trials: Sequence[RLHFTrial]) -> RLHFRow | None:
    """The next layout to probe, or None (module docstring)."""
    tried = {t.key() for t in trials}
    best = max((t.samples_per_second for t in trials if t.feasible), default=0.0)
    scale = calibration(rows, trials)
    candidates = [
        r for r in rows if layout_key(r) not in tried and may_fit(r) and not _ruled_out(r, trials)
    ]
    candidates.sort(key=lambda r: (-round(r.speed, 6), -r.share))
    for row in candidates:
        # A prediction equal to the best's own, scaled by the best's ratio, lands a rounding
        # above or below it: equal is no win (the relative tolerance is far below any noise).
        if best and row.speed * scale <= best * (1 + _SAME):
            return None
        return row
    return None


def measured_speed(row: RLHFRow, phase_s: dict[str, float], emulated: bool) -> float:
    """Samples a second of an iteration from a probe's phase seconds: the rollout and the
    switch predicted where the engine is emulated."""
    seconds = dict(phase_s)
    if emulated or "rollout" not in seconds:
        seconds["rollout"] = row.seconds["rollout"]
    seconds["switch"] = row.seconds["switch"]
    total = sum(seconds[p] for p in ("rollout", "scoring", "training", "switch"))
    return row.samples / total if total > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class RLHFSummary:
    """What a search of an iteration's layouts found."""

    study: str
    trials: list[RLHFTrial]
    """Every probe of the study, this run's and earlier ones'."""
    probes: int
    """Probes this run made."""
    stop_reason: str
    best: RLHFTrial | None

    @property
    def why_no_best(self) -> str | None:
        """Why no layout is the best (None when one is): memory's advice only where a probe
        ran out of it; where every probe failed otherwise (timed out, crashed), how many."""
        if self.best is not None:
            return None
        if any(t.outcome == "oom" for t in self.trials) or not self.trials:
            return "no layout fitted: lower --rollout-share, or let --sleep"
        counts = tally(t.outcome for t in self.trials)
        return (
            f"no layout was measured to fit or not ({counts}): each probe's log, in its "
            "folder under --trials-dir, says why"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "study": self.study,
            "probes": self.probes,
            "stop_reason": self.stop_reason,
            "best": None if self.best is None else self.best.to_dict(),
            "trials": [t.to_dict() for t in self.trials],
        }


def search(
    rows: Sequence[RLHFRow],
    trials: Iterable[RLHFTrial],
    probe: Callable[[RLHFRow], RLHFTrial],
    *,
    budget_left: Callable[[], float],
    cost: Callable[[RLHFRow], float],
    max_probes: int = 12,
) -> tuple[list[RLHFTrial], int, str]:
    """Probe layouts in :func:`propose`'s order until it has none, the budget would not pay
    for the next (``cost`` its predicted seconds), or ``max_probes``. Returns every trial,
    the number of probes made and why the search stopped."""
    known = list(trials)
    made = 0
    while True:
        row = propose(rows, known)
        if row is None:
            return known, made, "search done: no layout left can beat the best"
        if made >= max_probes:
            return known, made, f"stopped after {max_probes} probes"
        if cost(row) > budget_left():
            return known, made, "budget spent"
        known.append(probe(row))
        made += 1
