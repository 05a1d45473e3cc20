"""autotune: finds the fastest training configuration that fits your GPUs.

    import autotune

    summary = autotune.tune("llama-7b", budget="30m", seq_len=4096, global_batch=512)
    print(summary.best.config.label(), summary.best.micro_batch_size)

A training script that autotune runs (``autotune run --script train.py --framework torchrun``)
reads the configuration of its run with ``autotune.job_config()``.

The library (:mod:`autotune.api`) is loaded on first use, so that ``import autotune.config``
and the command line's ``--help`` stay instant; nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.api import (
        Export,
        JobResult,
        Plan,
        Report,
        RLHFPlan,
        StudyResult,
        Tuning,
        best,
        export,
        plan,
        plan_rlhf,
        prepare,
        probe,
        trials,
        tune,
        tune_rlhf,
        write_report,
    )
    from autotune.handoff.script import JobConfig, job_config

__all__ = [
    "Export",
    "JobConfig",
    "JobResult",
    "Plan",
    "RLHFPlan",
    "Report",
    "StudyResult",
    "Tuning",
    "best",
    "export",
    "job_config",
    "plan",
    "plan_rlhf",
    "prepare",
    "probe",
    "trials",
    "tune",
    "tune_rlhf",
    "write_report",
]


_HOMES = {"JobConfig": "autotune.handoff.script", "job_config": "autotune.handoff.script"}
"""Names not in :mod:`autotune.api`: what a training script reads stays light."""


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(_HOMES.get(name, "autotune.api")), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
