"""The trial database of RL-iteration searches: one Optuna study per RLHF workload.

Each probe of an iteration is one trial: its layout (the trainer's configuration, the engine's
share and sleep, the micro-batch) as user attributes, its outcome, each phase's measured peak
and seconds, and as the objective the samples per second of whole iterations (0 for a
layout that ran out of memory, ``feasible`` false). The study carries the workload under
:data:`RLHF_ATTR`, not the training studies' fingerprint, so ``autotune best`` and
``trials`` (which read those) leave it alone; ``autotune run --rlhf`` resumes from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna

from autotune.config import TrainConfig
from autotune.study.fingerprint import software_versions
from autotune.study.schema import holds_no_database, refuse_foreign_sqlite, sqlite_path
from autotune.study.store import _optuna_quiet, open_storage
from autotune.tuned.rlhf import Placement

__all__ = ["RLHF_ATTR", "RLHFStudy", "RLHFTrial", "layout_key"]

RLHF_ATTR = "autotune_rlhf"
"""The study user attribute that holds an RLHF study's workload."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFTrial:
    """One probe of an iteration, as the study keeps it."""

    config: TrainConfig
    share: float
    sleep: bool
    micro_batch_size: int
    outcome: str
    """``ok``, ``oom``, or another probe outcome."""
    samples_per_second: float
    frozen: Placement = Placement.RESIDENT
    """Where the frozen models waited."""
    stage: str | None = None
    phases: Mapping[str, int] = field(default_factory=dict)
    """Each phase's measured peak bytes."""
    seconds: Mapping[str, float] = field(default_factory=dict)
    """Each phase's seconds (the rollout and the switch predicted where the engine is
    emulated)."""
    probe_dir: str = ""
    number: int | None = None

    @property
    def feasible(self) -> bool:
        return self.outcome == "ok" and self.samples_per_second > 0

    def key(self) -> tuple[Any, ...]:
        return layout_key(self)

    def to_attrs(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.label(),
            "rollout_share": self.share,
            "sleep": self.sleep,
            "frozen": self.frozen.value,
            "micro_batch_size": self.micro_batch_size,
            "outcome": self.outcome,
            "stage": self.stage,
            "phase_peak_bytes": dict(self.phases),
            "phase_s": dict(self.seconds),
            "probe_dir": self.probe_dir,
            "feasible": self.feasible,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.to_attrs(),
            "number": self.number,
            "samples_per_second": self.samples_per_second,
        }

    @classmethod
    def from_trial(cls, trial: optuna.trial.FrozenTrial) -> RLHFTrial:
        attrs = trial.user_attrs
        return cls(
            config=TrainConfig.from_dict(attrs["config"]),
            share=float(attrs["rollout_share"]),
            sleep=bool(attrs["sleep"]),
            frozen=Placement(attrs.get("frozen", Placement.RESIDENT.value)),
            micro_batch_size=int(attrs["micro_batch_size"]),
            outcome=str(attrs["outcome"]),
            samples_per_second=float(trial.value or 0.0),
            stage=attrs.get("stage"),
            phases=attrs.get("phase_peak_bytes") or {},
            seconds=attrs.get("phase_s") or {},
            probe_dir=str(attrs.get("probe_dir", "")),
            number=trial.number,
        )


def layout_key(layout: RLHFTrial | Any) -> tuple[Any, ...]:
    """What tells one layout from another, of a trial or of a planned row alike: the trainer's
    configuration, the engine's share and sleep, where the frozen models wait, the
    micro-batch."""
    return (layout.config, layout.share, layout.sleep, layout.frozen, layout.micro_batch_size)


class RLHFStudy:
    """The study of one RLHF workload (its models, lengths, batch, GPUs and software)."""

    def __init__(
        self,
        workload: Mapping[str, Any],
        *,
        storage: str,
        study: optuna.Study | None = None,
    ) -> None:
        """Open (or create) the study of ``workload``; ``study``: one already loaded."""
        if study is not None:
            self.workload = dict(study.user_attrs[RLHF_ATTR])
            self.name = study.study_name
            self.study = study
            return
        self.workload = {**workload, "software": software_versions()}
        digest = hashlib.sha256(json.dumps(self.workload, sort_keys=True).encode()).hexdigest()[:10]
        self.name = (
            f"rlhf/{workload['algorithm']}/{workload['policy']}@{workload['hardware']}/{digest}"
        )
        with _optuna_quiet():
            self.study = optuna.create_study(
                storage=open_storage(storage),
                study_name=self.name,
                direction="maximize",
                load_if_exists=True,
            )
        if RLHF_ATTR not in self.study.user_attrs:
            self.study.set_user_attr(RLHF_ATTR, self.workload)

    @classmethod
    def existing(cls, storage: str) -> list[RLHFStudy]:
        """Every RLHF study in ``storage``, oldest first (none in a SQLite file that does not
        exist, which is not created)."""
        path = sqlite_path(storage)
        if path is not None and holds_no_database(path):
            return []
        if path is not None:
            refuse_foreign_sqlite(path, writing=False)
        url = open_storage(storage, read_only=True)
        found = []
        for summary in optuna.get_all_study_summaries(url, include_best_trial=False):
            if RLHF_ATTR in summary.user_attrs:
                study = optuna.load_study(study_name=summary.study_name, storage=url)
                found.append(cls({}, storage=storage, study=study))
        return found

    def trials(self) -> list[RLHFTrial]:
        """Every recorded probe, oldest first."""
        return [
            RLHFTrial.from_trial(t)
            for t in self.study.get_trials(deepcopy=False)
            if t.state is optuna.trial.TrialState.COMPLETE and "config" in t.user_attrs
        ]

    def record(self, trial: RLHFTrial) -> RLHFTrial:
        """Add a probe as a complete trial; it back with its number."""
        frozen = optuna.trial.create_trial(
            value=trial.samples_per_second,
            user_attrs=trial.to_attrs(),
        )
        self.study.add_trial(frozen)
        number = self.study.get_trials(deepcopy=False)[-1].number
        return dataclasses.replace(trial, number=number)

    def best(self) -> RLHFTrial | None:
        feasible = [t for t in self.trials() if t.feasible]
        return max(feasible, key=lambda t: t.samples_per_second, default=None)
