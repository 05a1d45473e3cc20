"""Every autotune study of a trial database, read back without Optuna.

``autotune best`` and ``trials``, and the training launchers that read the best configuration,
only read. Opening the database through Optuna costs most of a second (Optuna and Alembic
imports, the schema's version check) for a query of a few milliseconds, so this reader runs
plain SQL on Optuna's tables through SQLAlchemy Core, on SQLite and PostgreSQL alike.

It reads only the schema it knows (``KNOWN_SCHEMAS``, Optuna's Alembic revision); a database
of any other revision, or one without Optuna's tables, is read through Optuna instead, which
upgrades or explains it. Nothing is written: a SQLite file that does not exist holds no study
and is not created.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sqlalchemy
from sqlalchemy import bindparam, text

from autotune.config import ConfigError
from autotune.study.fingerprint import DEFAULT_STORAGE, Fingerprint
from autotune.study.measurement import Measurement, StudyResult, decode

__all__ = ["KNOWN_SCHEMAS", "cannot_open", "read_studies", "sqlite_path"]

KNOWN_SCHEMAS = frozenset({"v3.2.0.a"})
"""Optuna's schema revisions (``alembic_version``) this reader understands: Optuna 3.2 to 5."""

FINGERPRINT_ATTR = "autotune_fingerprint"
"""The study user attribute that makes an Optuna study an autotune study."""

_CONSTRAINTS = "constraints"
"""Optuna keeps a trial's constraint values in system attributes named ``constraints:<name>``
(Optuna 5) or in one list named ``constraints`` (before)."""


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL, without the URL's options (None for other databases
    and in-memory ones)."""
    if not url.startswith("sqlite:///"):
        return None
    path = Path(url.removeprefix("sqlite:///").partition("?")[0])
    return None if str(path) in ("", ":memory:") else path.expanduser()


def cannot_open(url: str, error: Exception) -> ConfigError:
    """The one line that says a storage URL cannot be opened, and what to use."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(
        f"cannot open trial storage {url!r}: {reason}; use sqlite:///path/to.db or "
        "postgresql://user:password@host/database"
    )


def read_studies(url: str = DEFAULT_STORAGE) -> list[StudyResult]:
    """Every autotune study in a storage, in the order they were created.

    Raises:
        ConfigError: When the storage cannot be opened (one line that says what to use).
    """
    path = sqlite_path(url)
    if path is not None and not path.is_file():
        return []
    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    except Exception as error:  # a malformed URL or a missing driver: both mean "cannot open"
        raise cannot_open(url, error) from None
    try:
        with engine.connect() as connection:
            studies = _read(connection)
    except sqlalchemy.exc.OperationalError as error:
        if _no_tables(error):
            studies = None
        else:
            raise cannot_open(url, error) from None
    except sqlalchemy.exc.ProgrammingError:  # PostgreSQL: no such table
        studies = None
    except sqlalchemy.exc.SQLAlchemyError as error:
        raise cannot_open(url, error) from None
    finally:
        engine.dispose()
    return _through_optuna(url) if studies is None else studies


def _no_tables(error: sqlalchemy.exc.OperationalError) -> bool:
    return "no such table" in str(error.orig)


def _through_optuna(url: str) -> list[StudyResult]:
    """Another schema revision, or none yet: Optuna checks, upgrades or says why."""
    from autotune.study.store import TrialStore

    return [
        StudyResult(fingerprint=store.fingerprint, measurements=store.measurements())
        for store in TrialStore.existing(url)
    ]


def _read(connection: sqlalchemy.Connection) -> list[StudyResult] | None:
    """The studies, or None when the schema is not one this reader knows."""
    revisions = connection.execute(text("SELECT version_num FROM alembic_version"))
    versions = {row[0] for row in revisions}
    if not versions or not versions <= KNOWN_SCHEMAS:
        return None
    fingerprints = {
        study_id: Fingerprint.from_dict(json.loads(value))
        for study_id, value in connection.execute(
            text(
                "SELECT study_id, value_json FROM study_user_attributes WHERE key = :key "
                "ORDER BY study_id"
            ),
            {"key": FINGERPRINT_ATTR},
        )
    }
    if not fingerprints:
        return []
    ids = list(fingerprints)
    trials = list(
        connection.execute(
            text(
                "SELECT trial_id, number, study_id, state FROM trials "
                "WHERE study_id IN :ids ORDER BY study_id, number"
            ).bindparams(bindparam("ids", expanding=True)),
            {"ids": ids},
        )
    )
    per_trial = _TrialRows()
    of_studies = "WHERE trial_id IN (SELECT trial_id FROM trials WHERE study_id IN :ids)"
    for query, add in (
        ("SELECT trial_id, param_name, param_value, distribution_json FROM trial_params "
         f"{of_studies}",
         per_trial.add_param),
        (f"SELECT trial_id, key, value_json FROM trial_user_attributes {of_studies}",
         per_trial.add_user_attr),
        (f"SELECT trial_id, key, value_json FROM trial_system_attributes {of_studies} "
         "AND key LIKE 'constraints%'",
         per_trial.add_constraint),
        (f"SELECT trial_id, objective, value, value_type FROM trial_values {of_studies}",
         per_trial.add_value),
    ):  # fmt: skip
        statement = text(query).bindparams(bindparam("ids", expanding=True))
        for row in connection.execute(statement, {"ids": ids}).all():  # one fetch: fast
            add(*row)
    measurements: dict[int, list[Measurement]] = {study_id: [] for study_id in ids}
    for trial_id, number, study_id, state in trials:
        params = per_trial.params.get(trial_id, {})
        attrs = per_trial.user_attrs.get(trial_id, {})
        if "micro_batch_size" not in params or attrs.get("withdrawn"):
            continue
        measurements[study_id].append(
            decode(
                number=number,
                state=str(getattr(state, "name", state)),
                params=params,
                user_attrs=attrs,
                constraints=per_trial.constraints.get(trial_id, ()),
                value=per_trial.values.get(trial_id),
            )
        )
    return [
        StudyResult(fingerprint=fingerprints[study_id], measurements=measurements[study_id])
        for study_id in ids
    ]


class _TrialRows:
    """The rows of Optuna's per-trial tables, gathered by trial and decoded.

    A study's trials repeat the same few distributions and attribute values thousands of
    times: each distinct JSON text is decoded once. A decoded value may then be shared by
    several trials; :func:`~autotune.study.measurement.decode` copies the attributes it keeps.
    """

    def __init__(self) -> None:
        self.params: dict[int, dict[str, Any]] = defaultdict(dict)
        self.user_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
        self.constraints: dict[int, list[float]] = defaultdict(list)
        self.values: dict[int, float] = {}
        self._decoded: dict[str, Any] = {}

    def _loads(self, text: str) -> Any:
        try:
            return self._decoded[text]
        except KeyError:
            value = self._decoded[text] = json.loads(text)
            return value

    def add_param(self, trial_id: int, name: str, value: float, distribution: str) -> None:
        self.params[trial_id][name] = _external(value, self._loads(distribution))

    def add_user_attr(self, trial_id: int, key: str, value: str) -> None:
        self.user_attrs[trial_id][key] = self._loads(value)

    def add_constraint(self, trial_id: int, key: str, value: str) -> None:
        decoded = json.loads(value)
        if key == _CONSTRAINTS and isinstance(decoded, list):
            self.constraints[trial_id].extend(float(v) for v in decoded)
        elif key.startswith(_CONSTRAINTS + ":"):
            self.constraints[trial_id].append(float(decoded))

    def add_value(self, trial_id: int, objective: int, value: float | None, kind: Any) -> None:
        if objective != 0:
            return
        kind = str(getattr(kind, "name", kind))
        self.values[trial_id] = (
            math.inf if kind == "INF_POS" else -math.inf if kind == "INF_NEG" else float(value or 0)
        )


def _external(value: float, distribution: dict[str, Any]) -> Any:
    """A parameter as the user set it: Optuna stores a categorical choice by its index."""
    name = distribution.get("name", "")
    if name == "CategoricalDistribution":
        choices: Iterable[Any] = distribution["attributes"]["choices"]
        return list(choices)[int(value)]
    if "Int" in name:
        return round(value)
    return float(value)
