"""The trial database: one Optuna study per workload × hardware × software fingerprint.

- ``fingerprint``: what a study is about, and its readable name (no Optuna: light to import).
- ``measurement``: a trial decoded (:class:`Measurement`), repeats pooled (no Optuna either).
- ``schema``: what a database must hold to be a trial database, checked before opening it.
- ``reader``: every study of a database read back without Optuna (``autotune best``).
- ``store``: each probed micro-batch size as a trial (params: the configuration; attributes:
  the measurements; OOMs as infeasible trials), in SQLite or PostgreSQL.

The store's names load Optuna and SQLAlchemy on first use, so that ``autotune plan`` and
``--help``, which never open a study, do not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autotune.study.fingerprint import DEFAULT_STORAGE, Fingerprint, Objective, software_versions
from autotune.study.measurement import Measurement, pooled

if TYPE_CHECKING:
    from autotune.study.store import TrialStore, open_storage

_STORE_NAMES = ("TrialStore", "open_storage")

__all__ = [
    "DEFAULT_STORAGE",
    "Fingerprint",
    "Measurement",
    "Objective",
    "TrialStore",
    "open_storage",
    "pooled",
    "software_versions",
]


def __getattr__(name: str) -> Any:
    if name in _STORE_NAMES:
        return getattr(importlib.import_module("autotune.study.store"), name)
    raise AttributeError(f"module 'autotune.study' has no attribute {name!r}")
