"""What the reader and the store both know of a trial database before opening it: Optuna's
tables and schema revision, the attributes autotune adds to them, the URL's SQLite file, the
checks that refuse a database of another program, and the one line that says a storage
cannot be opened.

No Optuna and no SQLAlchemy: Python's ``sqlite3`` looks at a file before either opens it.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autotune.config import ConfigError
from autotune.urls import check_storage_url, masked, redact

__all__ = [
    "CONSTRAINTS",
    "FINGERPRINT_ATTR",
    "GENERATION",
    "GRACE_S",
    "HEARTBEAT_S",
    "KNOWN_SCHEMAS",
    "OPTUNA_INDEXES",
    "OPTUNA_TABLES",
    "WITHDRAWN",
    "cannot_open",
    "check_storage",
    "holds_no_database",
    "refuse_foreign_sqlite",
    "sqlite_path",
    "trial_generation",
]

HEARTBEAT_S = 30
"""A running tuner touches its RUNNING trials this often; after ``GRACE_S`` without a beat
they are failed (their tuner died, on another host) and their point is retried once;
``autotune trials`` shows them as stale from then on."""
GRACE_S = 180

KNOWN_SCHEMAS = frozenset({"v3.2.0.a"})
"""Optuna's schema revisions (``alembic_version``) this reader understands: Optuna 3.2 to 5."""

FINGERPRINT_ATTR = "autotune_fingerprint"
"""The study user attribute that makes an Optuna study an autotune study."""

CONSTRAINTS = "constraints"
"""The trial system attribute of a trial's constraint values: one list under this name (what
the store writes, and the one form optuna-dashboard reads), or, from Optuna 5's
``Trial.set_constraint``, one value each under ``constraints:<name>``."""

WITHDRAWN = "withdrawn"
"""The user attribute of a claim withdrawn in a race with another worker (not counted)."""

GENERATION = "generation"
"""A study's measurements are of one generation: a re-tune (a nightly job's ``--max-age``)
measures the study again as the next one, its trials beside the earlier ones. The trial user
attribute says which generation a trial is of (none: the first, 0); the study user attribute
which generation its readers read (none: 0), set once the new one has a configuration that
fits, so a launcher reading the study mid-re-tune still gets the last complete answer."""


def trial_generation(attrs: Mapping[str, Any]) -> int:
    """The generation a trial is of, from its user attributes (:data:`GENERATION`)."""
    return int(attrs.get(GENERATION, 0))


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL, without the URL's options (None for other databases
    and in-memory ones)."""
    if not url.startswith("sqlite:///"):
        return None
    path = Path(url.removeprefix("sqlite:///").partition("?")[0])
    return None if str(path) in ("", ":memory:") else path.expanduser()


OPTUNA_TABLES: dict[str, frozenset[str]] = {
    "studies": frozenset({"study_id", "study_name"}),
    "version_info": frozenset({"version_info_id", "schema_version", "library_version"}),
    "alembic_version": frozenset({"version_num"}),
    "study_directions": frozenset({"study_direction_id", "direction", "study_id", "objective"}),
    "study_user_attributes": frozenset(
        {"study_user_attribute_id", "study_id", "key", "value_json"}
    ),
    "study_system_attributes": frozenset(
        {"study_system_attribute_id", "study_id", "key", "value_json"}
    ),
    "trials": frozenset(
        {"trial_id", "number", "study_id", "state", "datetime_start", "datetime_complete"}
    ),
    "trial_heartbeats": frozenset({"trial_heartbeat_id", "trial_id", "heartbeat"}),
    "trial_intermediate_values": frozenset(
        {
            "trial_intermediate_value_id",
            "trial_id",
            "step",
            "intermediate_value",
            "intermediate_value_type",
        }
    ),
    "trial_params": frozenset(
        {"param_id", "trial_id", "param_name", "param_value", "distribution_json"}
    ),
    "trial_system_attributes": frozenset(
        {"trial_system_attribute_id", "trial_id", "key", "value_json"}
    ),
    "trial_user_attributes": frozenset(
        {"trial_user_attribute_id", "trial_id", "key", "value_json"}
    ),
    "trial_values": frozenset({"trial_value_id", "trial_id", "objective", "value", "value_type"}),
}
"""Optuna's tables in the schema revisions of :data:`KNOWN_SCHEMAS`, each with exactly its
columns: as Optuna creates them, and as Alembic's upgrades from older revisions leave them
(in another order). On SQLite Optuna creates them one by one, then its version row
(``version_info``), then its revision (``alembic_version``)."""

OPTUNA_INDEXES: dict[str, str] = {
    "ix_studies_study_name": "studies",
    "ix_trials_study_id": "trials",
    "trials_study_id_key": "trials",  # the upgrade to v3.2.0.a names it so
}
"""The indexes Optuna creates by name, and the table of each. Its unique constraints' indexes
are SQLite's own (``sqlite_autoindex_<table>_<n>``, with no SQL of their own)."""

VERSION_TABLE = "version_info"
"""Optuna's version row: the library that made the schema, written before its revision."""
REVISION_TABLE = "alembic_version"
"""Optuna's schema revision (Alembic's table): written last when Optuna creates a schema."""


def _not_optunas(path: Path) -> list[str] | None:
    """What the SQLite file ``path`` holds that Optuna does not make, in words (empty: it is
    Optuna's database, or one Optuna is creating right now), or None when it is not a database
    at all (opening it says so). Read-only: the file keeps every byte and its time.

    Every table, view, trigger and index of ``sqlite_master`` is looked at:

    - a view or a trigger is never Optuna's, nor is an index Optuna does not name
      (:data:`OPTUNA_INDEXES`) or a table it does not have (:data:`OPTUNA_TABLES`);
    - at a revision of :data:`KNOWN_SCHEMAS`, and while Optuna creates its schema (no
      revision yet), each table has exactly Optuna's columns, and until the revision is
      written no table but the version row's holds a row: Optuna writes nothing else first;
    - at another revision (an older or a newer Optuna's, read through Optuna), whose columns
      this module does not know, the tables are Optuna's by name and its version row is there.
    """
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        entries = connection.execute("SELECT type, name, tbl_name, sql FROM sqlite_master")
        return _schema_problems(connection, entries.fetchall())
    except sqlite3.Error:
        return None
    finally:
        connection.close()


def _schema_problems(
    connection: sqlite3.Connection, entries: Sequence[tuple[str, str, str, str | None]]
) -> list[str]:
    """:func:`_not_optunas` on an open database, from its ``sqlite_master`` rows."""
    found: list[str] = []
    tables = set()
    for kind, name, table, sql in entries:
        if kind == "table" and not name.startswith("sqlite_"):  # sqlite_*: SQLite's own
            tables.add(name)
        elif kind in ("view", "trigger"):
            found.append(f"{kind} {name!r}")
        elif kind == "index" and sql is not None and OPTUNA_INDEXES.get(name) != table:
            found.append(f"index {name!r}")
    found += [f"table {name!r}" for name in sorted(tables - OPTUNA_TABLES.keys())]
    ours = [name for name in OPTUNA_TABLES if name in tables]  # this module's own names
    columns = {name: _columns(connection, name) for name in ours}
    revisions = (
        {row[0] for row in connection.execute(f"SELECT version_num FROM {REVISION_TABLE}")}
        if columns.get(REVISION_TABLE) == OPTUNA_TABLES[REVISION_TABLE]
        else set()
    )
    if revisions and not revisions <= KNOWN_SCHEMAS:  # another Optuna's: its version row
        versioned = columns.get(VERSION_TABLE) == OPTUNA_TABLES[VERSION_TABLE]
        if not (versioned and _holds_rows(connection, VERSION_TABLE)):
            shown = ", ".join(sorted(map(str, revisions)))
            found.append(f"{REVISION_TABLE} {shown} without Optuna's {VERSION_TABLE}")
        return found
    found += [
        f"table {name!r} with other columns"
        for name in ours
        if columns[name] != OPTUNA_TABLES[name]
    ]
    if not revisions:  # Optuna's schema being made: nothing written in it but its version
        found += [
            f"rows in {name!r} without Optuna's revision ({REVISION_TABLE})"
            for name in ours
            if name != VERSION_TABLE and columns[name] and _holds_rows(connection, name)
        ]
    return found


def _columns(connection: sqlite3.Connection, table: str) -> frozenset[str]:
    """The column names of ``table`` (a parameter of the query: any name reads as itself;
    empty where they cannot be read, as for a virtual table of a module not loaded here)."""
    try:
        rows = connection.execute("SELECT name FROM pragma_table_info(?)", (table,))
        return frozenset(name for (name,) in rows)
    except sqlite3.Error:
        return frozenset()


def _holds_rows(connection: sqlite3.Connection, table: str) -> bool:
    """Whether one of Optuna's tables holds a row (``table``: a name of
    :data:`OPTUNA_TABLES`, a constant of this module)."""
    assert table in OPTUNA_TABLES
    return connection.execute(f'SELECT EXISTS (SELECT 1 FROM "{table}")').fetchone()[0] == 1


def holds_no_database(path: Path) -> bool:
    """A SQLite file that does not exist, or is empty: no study, and nothing to refuse."""
    return not path.is_file() or path.stat().st_size == 0


def refuse_foreign_sqlite(path: Path, *, writing: bool = True) -> None:
    """Refuse a SQLite file that is not Optuna's (:func:`_not_optunas`), before anything
    reads or writes it: it is someone else's database, even where its tables are named as
    Optuna's (``studies``, ``trials``) and have Optuna's columns among their own, or it holds
    only a view. With ``writing``, refuse one whose schema revision is not one autotune
    writes (:func:`_other_revision`) too: Optuna creates the tables it misses before it
    checks the revision, so no Optuna opens it to write here (a reader's Optuna opens it
    read-only, creating and checking nothing).

    Raises:
        ConfigError: One line naming the file and what in it is not Optuna's, and what to do.
    """
    if holds_no_database(path):
        return
    foreign = _not_optunas(path)
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise ConfigError(
            f"{path} is a SQLite database of something else ({shown}): autotune keeps its "
            "trials in a database of its own; give --storage another file"
        )
    other = _other_revision(path) if writing else None
    if other is not None:
        raise ConfigError(
            f"{path} holds Optuna's schema {other}, which autotune writes at "
            f"{', '.join(sorted(KNOWN_SCHEMAS))} only, and changes nothing in: upgrade a copy "
            "of an older Optuna's with `optuna storage upgrade --storage sqlite:///COPY`, read "
            "a newer Optuna's with that Optuna, or give --storage another file"
        )


def _other_revision(path: Path) -> str | None:
    """The schema revision of Optuna's database ``path`` in words, where it is not one of
    :data:`KNOWN_SCHEMAS` (``at revision v3.0.0.d, written by Optuna 3.0.6``; several
    revision rows are no revision), or None: a known one, or none yet. Read-only."""
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error:
        return None
    try:
        if _columns(connection, REVISION_TABLE) != OPTUNA_TABLES[REVISION_TABLE]:
            return None
        rows = [row[0] for row in connection.execute(f"SELECT version_num FROM {REVISION_TABLE}")]
        if len(rows) == 1 and rows[0] in KNOWN_SCHEMAS:
            return None
        if not rows:
            return None  # Optuna's schema being made
        library = None
        if _columns(connection, VERSION_TABLE) == OPTUNA_TABLES[VERSION_TABLE]:
            found = connection.execute(f"SELECT library_version FROM {VERSION_TABLE}").fetchone()
            library = None if found is None else str(found[0])
    except sqlite3.Error:
        return None
    finally:
        connection.close()
    shown = ", ".join(repr(str(row)) for row in rows)
    what = f"at revision {shown}" if len(rows) == 1 else f"with {len(rows)} revisions ({shown})"
    return what + (f", written by Optuna {library!r}" if library else "")


def check_storage(url: str, *, writing: bool = True) -> None:
    """Refuse a storage a run could not use, opening and creating nothing: a URL that is no
    storage (:func:`~autotune.urls.check_storage_url`) or a SQLite file of another
    program, or with ``writing`` at a schema revision autotune does not write
    (:func:`refuse_foreign_sqlite`). A server's database is not reached.

    Raises:
        ConfigError: One line that says what to use.
    """
    check_storage_url(url)
    path = sqlite_path(url)
    if path is not None:
        refuse_foreign_sqlite(path, writing=writing)


def cannot_open(url: str, error: Exception) -> ConfigError:
    """The one line that says a storage URL cannot be opened, and what to use."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(
        f"cannot open trial storage {masked(url)!r}: {redact(reason, url)}; {_hint(reason)}"
    )


def _hint(reason: str) -> str:
    """What to do about a database that cannot be opened or written, by what it said."""
    if "locked" in reason:
        return (
            "another process holds it (another tuner's write, or a program with a transaction "
            "open): run again when it is done; several tuner workers need PostgreSQL"
        )
    if "readonly" in reason or "read-only" in reason or "unable to open" in reason:
        return "it cannot be written here: check the file's and its folder's permissions"
    if "full" in reason:
        return "free space there, or give --storage another file"
    return "use sqlite:///path/to.db or postgresql://user:password@host/database"
