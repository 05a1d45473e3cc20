"""Every autotune study of a trial database, read back without Optuna.

``autotune best`` and ``trials``, and the training launchers that read the best configuration,
only read. Opening the database through Optuna costs most of a second (Optuna and Alembic
imports, the schema's version check) for a query of a few milliseconds, so this reader runs
plain SQL on Optuna's tables: through Python's own ``sqlite3`` for a SQLite file, through
SQLAlchemy Core for PostgreSQL and any other URL.

A study of 10,000 trials holds some 300,000 rows of user attributes. Every row of a trial is
read only for the trials shown (``read_studies(last=N)``) and the best point's latest trial:
pooling the best point reads the params, constraints and value of every trial but only a few
of its attributes (``POOLED_ATTRS``), and counting the trials only which have a micro-batch
size and which are withdrawn claims.

It reads only the schema it knows (``KNOWN_SCHEMAS``, Optuna's Alembic revision); a database
of any other revision is read through Optuna instead, read-only. Nothing is written: a SQLite
file that does not exist, or is empty, holds no study and is neither created nor given
tables; a SQLite file of another program (:func:`refuse_foreign_sqlite`: anything in it that
Optuna's schema does not hold) is refused.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from autotune.config import ConfigError
from autotune.study.fingerprint import DEFAULT_STORAGE, Fingerprint
from autotune.study.measurement import (
    POOLED_ATTRS,
    Measurement,
    Point,
    StoredTrial,
    StudyResult,
    best_group,
    best_point,
    decode,
    parse_time,
    point,
    pool,
)
from autotune.study.schema import (
    CONSTRAINTS,
    FINGERPRINT_ATTR,
    GENERATION,
    GRACE_S,
    KNOWN_SCHEMAS,
    WITHDRAWN,
    cannot_open,
    check_storage,
    holds_no_database,
    sqlite_path,
    trial_generation,
)
from autotune.units import format_duration
from autotune.urls import masked

__all__ = ["read_studies"]

MICRO_BATCH_SIZE = "micro_batch_size"
"""The param every trial of a probed size has (other trials are not counted)."""


def read_studies(
    url: str = DEFAULT_STORAGE, *, last: int | None = None, best: bool = True
) -> list[StudyResult]:
    """Every autotune study in a storage, in the order they were created.

    Args:
        last: Decode only the last ``last`` trials (by number) of each study; None: every
            one. The count and the best are over every trial either way, but a study's
            best and the trials shown are then the only ones whose every attribute is read.
        best: Find each study's best point (else ``best`` is None, and with ``last`` the
            trials not shown are only counted: ``autotune trials --last N``).

    Raises:
        ConfigError: When the storage cannot be opened (one line that says what to use), or
            ``last`` is negative.
    """
    if last is not None and last < 0:
        raise ConfigError(f"cannot show the last {last} trials: use 0 or more")
    check_storage(url, writing=False)
    path = sqlite_path(url)
    if path is not None and holds_no_database(path):
        return []
    if path is not None and "?" not in url:
        studies = _read_sqlite_file(url, path, last, best)
    else:
        studies = _read_through_sqlalchemy(url, last, best)
    return _through_optuna(url, last, best) if studies is None else studies


def _read_sqlite_file(
    url: str, path: Path, last: int | None, with_best: bool
) -> list[StudyResult] | None:
    """A SQLite file through Python's own driver: SQLAlchemy's import alone takes a few
    tenths of a second. The queries run in one read transaction: one snapshot of the study,
    even while a tuner writes to it."""
    try:
        connection = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error as error:
        raise cannot_open(url, error) from None
    try:
        connection.execute("BEGIN")
        return _read(lambda query: connection.execute(query).fetchall(), last, with_best)
    except sqlite3.OperationalError as error:
        if "no such table" in str(error):
            return None
        raise cannot_open(url, error) from None
    except sqlite3.Error as error:  # "file is not a database", ...
        raise cannot_open(url, error) from None
    finally:
        connection.close()


def _read_through_sqlalchemy(
    url: str, last: int | None, with_best: bool
) -> list[StudyResult] | None:
    """Any other database (PostgreSQL, a SQLite URL with options) through SQLAlchemy Core."""
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    except Exception as error:  # a malformed URL or a missing driver: both mean "cannot open"
        raise cannot_open(url, error) from None
    try:
        with engine.connect() as connection:
            if connection.dialect.name == "postgresql":
                # One snapshot for every query, even while a tuner writes to the study.
                connection.execution_options(isolation_level="REPEATABLE READ")
            run = connection.execute
            return _read(lambda query: run(sqlalchemy.text(query)).all(), last, with_best)
    except sqlalchemy.exc.OperationalError as error:
        if "no such table" in str(error.orig):
            return None
        raise cannot_open(url, error) from None
    except sqlalchemy.exc.ProgrammingError:  # PostgreSQL: no such table
        return None
    except sqlalchemy.exc.SQLAlchemyError as error:
        raise cannot_open(url, error) from None
    finally:
        engine.dispose()


def _through_optuna(url: str, last: int | None, with_best: bool) -> list[StudyResult]:
    """Another schema revision, or none yet: read through Optuna, read-only (it creates and
    checks nothing); a schema Optuna cannot read either (tables it misses, other columns) is
    one line that says so."""
    from autotune.study.store import STORAGE_ERRORS, TrialStore, storage_problem

    try:
        return [
            StudyResult.of(
                store.fingerprint,
                store.measurements(),
                last=last,
                best=with_best,
                updated=store.updated(),
            )
            for store in TrialStore.existing(url)
        ]
    except STORAGE_ERRORS as error:
        raise ConfigError(
            f"cannot read trial storage {masked(url)!r}: its schema is not the Optuna schema "
            f"autotune reads ({', '.join(sorted(KNOWN_SCHEMAS))}), and Optuna could not read "
            f"it either ({storage_problem(error)}): read it with the Optuna that wrote it"
        ) from None


Query = Callable[[str], Sequence[Sequence[Any]]]
"""Runs one SQL statement (no parameters) and returns its rows."""

_CHUNK = 500
"""Trial ids per ``IN (...)`` list."""


def _read(query: Query, last: int | None, with_best: bool) -> list[StudyResult] | None:
    """The studies, or None when the schema is not one this reader knows.

    Every value spliced into the SQL is an integer read from the database or a constant of
    this module.
    """
    versions = {row[0] for row in query("SELECT version_num FROM alembic_version")}
    if not versions or not versions <= KNOWN_SCHEMAS:
        return None
    fingerprints = {
        study_id: Fingerprint.from_dict(json.loads(value))
        for study_id, value in query(
            "SELECT study_id, value_json FROM study_user_attributes "
            f"WHERE key = '{FINGERPRINT_ATTR}' ORDER BY study_id"
        )
    }
    if not fingerprints:
        return []
    studies = _ints(fingerprints)
    generations = {
        study_id: int(json.loads(value))
        for study_id, value in query(
            "SELECT study_id, value_json FROM study_user_attributes "
            f"WHERE key = '{GENERATION}' AND study_id IN ({studies})"
        )
    }
    trials = query(
        "SELECT trial_id, number, study_id, state, datetime_complete FROM trials "
        f"WHERE study_id IN ({studies}) ORDER BY study_id, number"
    )
    ended = {row[0]: parse_time(row[4]) for row in trials}
    of_studies = f"trial_id IN (SELECT trial_id FROM trials WHERE study_id IN ({studies}))"
    rows = _TrialRows()
    running = [row[0] for row in trials if str(getattr(row[3], "name", row[3])) == "RUNNING"]
    rows.silent = _silent_for(query, running) if running else {}
    if last is None:  # every row of every trial
        rows.read(query, of_studies)
        counted = _counted(fingerprints, trials, rows.sized(), generations, rows)
        updated = _updated(counted, ended)
        results = []
        for study_id, fingerprint in fingerprints.items():
            measurements = [rows.decode(t) for t in counted[study_id]]
            results.append(
                StudyResult(
                    fingerprint=fingerprint,
                    measurements=measurements,
                    trial_count=len(measurements),
                    best=best_point(measurements) if with_best else None,
                    updated=updated.get(study_id),
                )
            )
        return results
    best: dict[int, tuple[list[Point], _Trial]] = {}
    if with_best:
        # Each study's best point, from its completed trials as pooling reads them; the
        # point's latest trial, which the pooled measurement is made of, is decoded below
        # with every attribute.
        rows.read(query, of_studies, keys=(WITHDRAWN, GENERATION, *POOLED_ATTRS))
        counted = _counted(fingerprints, trials, rows.sized(), generations, rows)
        for study_id, kept in counted.items():
            completed = [t for t in kept if t.state == "COMPLETE"]
            points = [rows.point(t) for t in completed]
            group = best_group(points)
            if group is not None:
                top = max(group, key=lambda p: p.number)
                trial = next(t for p, t in zip(points, completed, strict=True) if p is top)
                best[study_id] = (group, trial)
    else:  # only which trials count
        sized = {
            trial_id
            for (trial_id,) in query(
                f"SELECT trial_id FROM trial_params WHERE {of_studies} "
                f"AND param_name = '{MICRO_BATCH_SIZE}'"
            )
        }
        for trial_id, key, value in query(
            "SELECT trial_id, key, value_json FROM trial_user_attributes "
            f"WHERE {of_studies} AND key IN ({_texts((WITHDRAWN, GENERATION))})"
        ):
            rows.add_user_attr(trial_id, key, value)
        counted = _counted(fingerprints, trials, sized, generations, rows)
    updated = _updated(counted, ended)
    shown = {study_id: kept[max(len(kept) - last, 0) :] for study_id, kept in counted.items()}
    full = {t.trial_id for kept in shown.values() for t in kept}
    full.update(trial.trial_id for _, trial in best.values())
    rows.read_trials(query, sorted(full))
    results = []
    for study_id, fingerprint in fingerprints.items():
        found = None
        if study_id in best:
            group, trial = best[study_id]
            found = pool(group, rows.decode(trial))
        results.append(
            StudyResult(
                fingerprint=fingerprint,
                measurements=[rows.decode(t) for t in shown[study_id]],
                trial_count=len(counted[study_id]),
                best=found,
                updated=updated.get(study_id),
            )
        )
    return results


def _counted(
    fingerprints: Iterable[int],
    trials: Iterable[Sequence[Any]],
    sized: set[int],
    generations: dict[int, int],
    rows: _TrialRows,
) -> dict[int, list[_Trial]]:
    """What each study counts, by number: its trials with a micro-batch size of the
    generation it reads (``generations``, by study; the trials' own from ``rows``), less the
    claims withdrawn in a race with another worker (``rows`` say which)."""
    withdrawn = rows.withdrawn()
    counted: dict[int, list[_Trial]] = {study_id: [] for study_id in fingerprints}
    for trial_id, number, study_id, state, _ in trials:
        if trial_id not in sized or trial_id in withdrawn:
            continue
        if rows.generation(trial_id) != generations.get(study_id, 0):
            continue  # an earlier generation's (or a re-tune's, before its first fit)
        counted[study_id].append(_Trial(trial_id, number, str(getattr(state, "name", state))))
    return counted


def _updated(
    counted: dict[int, list[_Trial]], ended: dict[int, dt.datetime | None]
) -> dict[int, dt.datetime | None]:
    """When each study's newest counted trial ended: the generation its readers read (a
    re-tune cut before its first fit leaves the study as old as its last answer)."""
    return {
        study_id: max((e for t in kept if (e := ended.get(t.trial_id)) is not None), default=None)
        for study_id, kept in counted.items()
    }


def _silent_for(query: Query, trial_ids: list[int]) -> dict[int, float]:
    """Seconds since each trial's last heartbeat (its start where it has none), by the
    database's own clock, which is the one that stamps heartbeats: ``LOCALTIMESTAMP``
    (PostgreSQL: the session's zone, as the stored stamps), else ``CURRENT_TIMESTAMP``
    (SQLite: UTC, as the stored stamps)."""
    now = None
    for sql in ("SELECT LOCALTIMESTAMP", "SELECT CURRENT_TIMESTAMP"):
        try:
            now = parse_time(query(sql)[0][0])
        except Exception:  # SQLite has no LOCALTIMESTAMP: either driver's error
            continue
        if now is not None:
            break
    if now is None:
        return {}
    now = now.replace(tzinfo=None)
    ids = _ints(trial_ids)
    last = {
        trial_id: parse_time(start)
        for trial_id, start in query(
            f"SELECT trial_id, datetime_start FROM trials WHERE trial_id IN ({ids})"
        )
    }
    for trial_id, beat in query(
        f"SELECT trial_id, heartbeat FROM trial_heartbeats WHERE trial_id IN ({ids})"
    ):
        last[trial_id] = parse_time(beat) or last.get(trial_id)
    return {
        trial_id: (now - when.replace(tzinfo=None)).total_seconds()
        for trial_id, when in last.items()
        if when is not None
    }


def _ints(values: Iterable[int]) -> str:
    return ",".join(str(int(v)) for v in values)


def _texts(values: Iterable[str]) -> str:
    quoted = []
    for value in values:
        if not value.replace("_", "").isalnum():
            raise ValueError(f"not a plain name: {value!r}")
        quoted.append(f"'{value}'")
    return ",".join(quoted)


class _Trial(NamedTuple):
    trial_id: int
    number: int
    state: str


class _TrialRows:
    """The rows of Optuna's per-trial tables, gathered by trial and decoded.

    A study's trials repeat the same few distributions and attribute values thousands of
    times: each distinct JSON text is decoded once (a distribution into the function that
    reads its parameters). A decoded value may then be shared by
    several trials; :func:`~autotune.study.measurement.decode` copies the attributes it keeps.
    """

    def __init__(self) -> None:
        self.params: dict[int, dict[str, Any]] = defaultdict(dict)
        self.user_attrs: dict[int, dict[str, Any]] = defaultdict(dict)
        self.constraints: dict[int, list[float]] = defaultdict(list)
        self.values: dict[int, float] = {}
        self._decoded: dict[str, Any] = {}
        self._externals: dict[str, Callable[[float], Any]] = {}
        self.silent: dict[int, float] = {}
        """Seconds since each RUNNING trial's tuner last heartbeat (or the trial started)."""

    def _loads(self, text: str) -> Any:
        try:
            return self._decoded[text]
        except KeyError:
            value = self._decoded[text] = json.loads(text)
            return value

    def add_param(self, trial_id: int, name: str, value: float, distribution: str) -> None:
        try:
            external = self._externals[distribution]
        except KeyError:
            external = self._externals[distribution] = _external(json.loads(distribution))
        self.params[trial_id][name] = external(value)

    def add_user_attr(self, trial_id: int, key: str, value: str) -> None:
        self.user_attrs[trial_id][key] = self._loads(value)

    def add_constraint(self, trial_id: int, key: str, value: str) -> None:
        if key.startswith(CONSTRAINTS + ":"):
            self.constraints[trial_id].append(_number(value))
            return
        decoded = json.loads(value)
        if key == CONSTRAINTS and isinstance(decoded, list):
            self.constraints[trial_id].extend(float(v) for v in decoded)

    def read(self, query: Query, where: str, keys: Iterable[str] | None = None) -> None:
        """The rows of the trials ``where`` selects: their params, constraints and values,
        and their user attributes (only ``keys`` when given)."""
        attrs = "" if keys is None else f" AND key IN ({_texts(keys)})"
        for statement, add in (
            ("SELECT trial_id, param_name, param_value, distribution_json FROM trial_params "
             f"WHERE {where}",
             self.add_param),
            (f"SELECT trial_id, key, value_json FROM trial_user_attributes WHERE {where}{attrs}",
             self.add_user_attr),
            ("SELECT trial_id, key, value_json FROM trial_system_attributes "
             f"WHERE {where} AND key LIKE '{CONSTRAINTS}%'",
             self.add_constraint),
            (f"SELECT trial_id, objective, value, value_type FROM trial_values WHERE {where}",
             self.add_value),
        ):  # fmt: skip
            for row in query(statement):
                add(*row)

    def read_trials(self, query: Query, trial_ids: list[int]) -> None:
        """Every row of these trials, in place of what was read of them so far."""
        for trial_id in trial_ids:
            for table in (self.params, self.user_attrs, self.constraints, self.values):
                table.pop(trial_id, None)
        for start in range(0, len(trial_ids), _CHUNK):
            self.read(query, f"trial_id IN ({_ints(trial_ids[start : start + _CHUNK])})")

    def sized(self) -> set[int]:
        """The trials read with a micro-batch size."""
        return {trial_id for trial_id, params in self.params.items() if MICRO_BATCH_SIZE in params}

    def withdrawn(self) -> set[int]:
        """The trials read that are withdrawn claims."""
        return {trial_id for trial_id, attrs in self.user_attrs.items() if attrs.get(WITHDRAWN)}

    def generation(self, trial_id: int) -> int:
        """The generation a trial read is of (none recorded: the first, 0)."""
        return trial_generation(self.user_attrs.get(trial_id, {}))

    def stored(self, trial: _Trial) -> StoredTrial:
        """A trial's fields, from the rows read of it."""
        return StoredTrial(
            number=trial.number,
            state=trial.state,
            params=self.params[trial.trial_id],
            user_attrs=self.user_attrs.get(trial.trial_id, {}),
            constraints=self.constraints.get(trial.trial_id, ()),
            value=self.values.get(trial.trial_id),
        )

    def decode(self, trial: _Trial) -> Measurement:
        """A trial from the rows read of it; a RUNNING one whose tuner stopped heartbeating
        longer ago than the grace period reads as ``stale``."""
        measurement = decode(self.stored(trial))
        silent = self.silent.get(trial.trial_id) if trial.state == "RUNNING" else None
        if silent is None or silent <= GRACE_S:
            return measurement
        return dataclasses.replace(
            measurement,
            outcome="stale",
            message=f"no heartbeat from its tuner for {format_duration(silent)}: the tuner is "
            "gone, and the next run fails this trial and probes its point again",
        )

    def point(self, trial: _Trial) -> Point:
        """A trial as pooling reads it, from the rows read of it."""
        return point(self.stored(trial))

    def add_value(self, trial_id: int, objective: int, value: float | None, kind: Any) -> None:
        if objective != 0:
            return
        kind = str(getattr(kind, "name", kind))
        self.values[trial_id] = (
            math.inf if kind == "INF_POS" else -math.inf if kind == "INF_NEG" else float(value or 0)
        )


def _external(distribution: dict[str, Any]) -> Callable[[float], Any]:
    """How a parameter of this distribution reads as the user set it: Optuna stores a
    categorical choice by its index."""
    name = distribution.get("name", "")
    if name == "CategoricalDistribution":
        choices = list(distribution["attributes"]["choices"])
        return lambda value: choices[int(value)]
    if "Int" in name:
        return round
    return float


def _number(text: str) -> float:
    """A stored JSON number (``0.25``, ``NaN``, ``Infinity``: all read by ``float``)."""
    try:
        return float(text)
    except ValueError:
        return float(json.loads(text))
