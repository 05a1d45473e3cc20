"""The trial database: one Optuna study per workload × hardware × software fingerprint.

- ``fingerprint``: what a study is about, and its readable name.
- ``store``: each probed micro-batch size as a trial (params: the configuration; attributes:
  the measurements; OOMs as infeasible trials), in SQLite or PostgreSQL.
"""

from __future__ import annotations

from autotune.study.fingerprint import OBJECTIVES, Fingerprint, software_versions
from autotune.study.store import (
    DEFAULT_STORAGE,
    Measurement,
    TrialStore,
    open_storage,
    pooled,
)

__all__ = [
    "DEFAULT_STORAGE",
    "OBJECTIVES",
    "Fingerprint",
    "Measurement",
    "TrialStore",
    "open_storage",
    "pooled",
    "software_versions",
]
