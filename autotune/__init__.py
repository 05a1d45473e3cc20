"""autotune: finds the fastest training configuration that fits your GPUs.

    import autotune

    summary = autotune.tune("llama-7b", budget="30m", seq_len=4096, global_batch=512)
    print(summary.best.config.label(), summary.best.micro_batch_size)

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
        StudyResult,
        Tuning,
        best,
        export,
        plan,
        prepare,
        probe,
        trials,
        tune,
        write_report,
    )

__all__ = [
    "Export",
    "JobResult",
    "Plan",
    "Report",
    "StudyResult",
    "Tuning",
    "best",
    "export",
    "plan",
    "prepare",
    "probe",
    "trials",
    "tune",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("autotune.api"), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")
