"""Hostile input: trial databases that are someone else's, and job files built to hurt.

- A SQLite file is Optuna's only when everything in it is: its tables by name and by their
  exact columns, no view, no trigger, no index Optuna does not make, and no row before
  Optuna's revision. Anything else is refused by every command with one line, exit 2, and
  the file keeps its bytes and its time; Optuna's own databases (new, half-made by another
  tuner, upgraded from an old revision) are taken as before.
- A job file's anchors and aliases are refused as the parser meets them (a few hundred bytes
  of nested aliases stand for gigabytes), and ``hosts:`` is a list of host names.
- Every workload of a job file is checked before the first one runs: a bad third workload
  stops the job before anything is tuned or written.
- A host name (and a probe's folder name) is the whole text: a trailing line break is no
  part of a name.

Everything is real: SQLite files, Optuna's own schema and upgrades, the console entry point.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy

from autotune.config import ConfigError
from autotune.jobs import read_jobs
from autotune.probe.nodes import check_host, nodes_from_environment
from autotune.study.reader import read_studies
from autotune.study.schema import refuse_foreign_sqlite
from tests.test_bad_input import one_line, run_main, snapshot
from tests.test_cli import autotune

SIM = ("--simulate", "h100-80gb")

# ------------------------------------------------------------------ foreign SQLite files


@pytest.fixture(scope="module")
def optuna_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real autotune study: a simulated run's database, made by Optuna."""
    folder = tmp_path_factory.mktemp("study")
    db = folder / "t.db"
    done = autotune(
        "run", "--model", "llama-7b", *SIM, "--budget", "5m", "--storage", f"sqlite:///{db}",
        cwd=folder,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return db


def _sql(*statements: str) -> Callable[[Path, Path], None]:
    """A database made by ``statements`` alone."""

    def make(db: Path, _: Path) -> None:
        with contextlib.closing(sqlite3.connect(db)) as connection:
            for statement in statements:
                connection.execute(statement)
            connection.commit()

    return make


def _optuna_and(*statements: str) -> Callable[[Path, Path], None]:
    """A copy of a real autotune study, then ``statements``."""

    def make(db: Path, optuna_db: Path) -> None:
        db.write_bytes(optuna_db.read_bytes())
        _sql(*statements)(db, optuna_db)

    return make


STUDIES = "CREATE TABLE studies (study_id INTEGER NOT NULL PRIMARY KEY, study_name VARCHAR(512){})"
TRIALS = (
    "CREATE TABLE trials (trial_id INTEGER PRIMARY KEY, number INTEGER, study_id INTEGER, "
    "state VARCHAR(8), datetime_start DATETIME, datetime_complete DATETIME{})"
)

FOREIGN: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "a table named it's mine": (
        _sql("""CREATE TABLE "it's mine" (id INTEGER)""", """INSERT INTO "it's mine" VALUES (1)"""),
        """table "it's mine\"""",
    ),
    "Optuna's columns among their own": (
        _sql(
            STUDIES.format(", subject TEXT"),
            TRIALS.format(", score REAL"),
            "INSERT INTO studies VALUES (1, 'chemistry', 'science')",
        ),
        "table 'studies' with other columns",
    ),
    "exactly Optuna's columns, holding rows, without Optuna's version": (
        _sql(STUDIES.format(""), TRIALS.format(""), "INSERT INTO studies VALUES (1, 'chemistry')"),
        "rows in 'studies' without Optuna's revision (alembic_version)",
    ),
    "a view alone": (_sql("CREATE VIEW totals AS SELECT 1 AS total"), "view 'totals'"),
    "another program's Alembic revision over tables named as Optuna's": (
        _sql(
            "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL PRIMARY KEY)",
            "INSERT INTO alembic_version VALUES ('ae1027a6acf')",
            STUDIES.format(", subject TEXT"),
            "INSERT INTO studies VALUES (1, 'chemistry', 'science')",
        ),
        "alembic_version ae1027a6acf without Optuna's version_info",
    ),
    "Optuna's database and a table of its own": (
        _optuna_and("CREATE TABLE notes (text TEXT)"),
        "table 'notes'",
    ),
    "Optuna's database with a column of its own": (
        _optuna_and("ALTER TABLE trials ADD COLUMN note TEXT"),
        "table 'trials' with other columns",
    ),
    "Optuna's database and a trigger": (
        _optuna_and(
            "CREATE TRIGGER audit AFTER INSERT ON trials BEGIN SELECT 1; END",
        ),
        "trigger 'audit'",
    ),
    "Optuna's database and an index of its own": (
        _optuna_and("CREATE INDEX by_state ON trials (state)"),
        "index 'by_state'",
    ),
}


@pytest.mark.parametrize("kind", FOREIGN)
def test_a_database_not_all_optunas_is_refused_by_every_command_and_kept(
    tmp_path: Path,
    optuna_db: Path,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make, says = FOREIGN[kind]
    db = tmp_path / "t.db"
    make(db, optuna_db)
    for _, line in _refused_by_every_command(db, monkeypatch, capsys):
        assert f"{db} is a SQLite database of something else" in line, line
        assert says in line and "give --storage another file" in line, line


def _refused_by_every_command(
    db: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> list[tuple[str, str]]:
    """``run``, ``best``, ``trials``, ``export`` and ``report`` on the SQLite file ``db``: each
    exits 2 with one line, and no byte of ``db``'s folder changes, nor ``db``'s time; each
    command's name and line."""
    os.utime(db, ns=(1_000_000_000, 1_000_000_000))  # a time any write would change
    before = snapshot(db.parent)
    url = ("--storage", f"sqlite:///{db}")
    lines = []
    for command in (
        ("run", "--model", "llama-7b", *SIM, "--budget", "5m", *url),
        ("best", *url),
        ("trials", *url),
        ("export", "--format", "deepspeed", *url),
        ("report", "-o", "r.html", *url),
    ):
        code, stderr = run_main(command, db.parent, monkeypatch, capsys)
        line = one_line(stderr)
        assert code == 2, (command, line)
        assert snapshot(db.parent) == before, command  # no byte changed, no file made
        assert db.stat().st_mtime_ns == 1_000_000_000, command
        lines.append((command[0], line))
    return lines


def _optuna_models() -> sqlalchemy.MetaData:
    from optuna.storages._rdb import models

    return models.BaseModel.metadata


def _create(db: Path, tables: list[str] | None, *, version_row: bool = False) -> None:
    """Optuna's tables made as Optuna makes them (its own models, its own ``create_all``):
    ``tables`` of them (None: all), then perhaps its version row, but no revision yet."""
    engine = sqlalchemy.create_engine(f"sqlite:///{db}")
    metadata = _optuna_models()
    chosen = None if tables is None else [metadata.tables[name] for name in tables]
    metadata.create_all(engine, tables=chosen)
    if version_row:
        with engine.begin() as connection:
            connection.execute(
                sqlalchemy.text(
                    "INSERT INTO version_info (version_info_id, schema_version, library_version) "
                    "VALUES (1, 12, '5.0.0')"
                )
            )
    engine.dispose()


def _upgraded(db: Path) -> None:
    """A database made by Optuna's own Alembic scripts, from their first revision to the head
    (another order of columns, the index the upgrade names ``trials_study_id_key``)."""
    import optuna
    from alembic import command
    from alembic.config import Config

    config = Config()
    scripts = Path(optuna.__file__).parent / "storages" / "_rdb" / "alembic"
    config.set_main_option("script_location", str(scripts))
    config.set_main_option("sqlalchemy.url", f"sqlite:///{db}")
    command.upgrade(config, "head")


OPTUNAS: dict[str, Callable[[Path], None]] = {
    "an empty file": lambda db: db.write_bytes(b""),
    "a database with no table yet": lambda db: _sql("PRAGMA user_version = 7")(db, db),
    "Optuna's first table, as another tuner creates it": lambda db: _create(db, ["studies"]),
    "Optuna's first tables and its version table": lambda db: _create(
        db, ["studies", "version_info"]
    ),
    "every table of Optuna's, before its version row": lambda db: _create(db, None),
    "every table and the version row, before the revision": lambda db: _create(
        db, None, version_row=True
    ),
    "upgraded by Optuna's Alembic scripts from their first revision": _upgraded,
}


@pytest.mark.parametrize("state", OPTUNAS)
def test_optunas_own_databases_are_taken_whole_half_made_or_upgraded(
    tmp_path: Path, state: str
) -> None:
    db = tmp_path / "t.db"
    OPTUNAS[state](db)
    refuse_foreign_sqlite(db)  # nothing in it that Optuna does not make
    assert read_studies(f"sqlite:///{db}") == []


def test_a_run_finishes_the_schema_another_tuner_began(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Optuna's tables made, its version row not yet written: a second tuner takes it."""
    db = tmp_path / "t.db"
    _create(db, None)
    url = f"sqlite:///{db}"
    code, stderr = run_main(
        ("run", "--model", "llama-7b", *SIM, "--budget", "5m", "--storage", url),
        tmp_path, monkeypatch, capsys,
    )  # fmt: skip
    assert code == 0, stderr
    [study] = read_studies(url)
    assert study.best is not None


def test_an_autotune_study_is_taken(optuna_db: Path) -> None:
    refuse_foreign_sqlite(optuna_db)
    [study] = read_studies(f"sqlite:///{optuna_db}")
    assert study.best is not None


REVISIONS: dict[str, tuple[str, ...]] = {
    "a revision no Optuna has": ("v9.9.9",),
    "an older Optuna's revision": ("v3.0.0.d",),
    "two revision rows": ("v3.2.0.a", "v9.9.9"),
}
"""Optuna's revision table with other revisions than the one autotune writes, over a user's
file that holds Optuna's version row and a ``studies`` table of its own (Optuna's columns):
Optuna would add its nine other tables to it before refusing the revision."""


@pytest.mark.parametrize("kind", REVISIONS)
def test_a_database_at_another_revision_is_changed_by_no_command(
    tmp_path: Path,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    db = tmp_path / "mine.db"
    rows = [f"INSERT INTO alembic_version VALUES ('{r}')" for r in REVISIONS[kind]]
    _sql(
        "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)",
        *rows,
        "CREATE TABLE version_info (version_info_id INTEGER NOT NULL PRIMARY KEY, "
        "schema_version INTEGER, library_version VARCHAR(256))",
        "INSERT INTO version_info VALUES (1, 12, '3.0.6')",
        STUDIES.format(""),
        "INSERT INTO studies VALUES (1, 'my own data')",
    )(db, db)
    for command, line in _refused_by_every_command(db, monkeypatch, capsys):
        if command == "run":
            assert f"{db} holds Optuna's schema " in line and "changes nothing" in line, line
        else:
            # Read through Optuna (read-only), which cannot read it either.
            assert line.startswith(("error: cannot read trial storage", "error: cannot open")), line


@pytest.mark.parametrize("query", ["mode=rwc&uri=true", "uri=1", "uri=TRUE&timeout=5"])
def test_sqlites_uri_form_is_refused_by_every_command_and_its_file_kept(
    tmp_path: Path,
    query: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``sqlite:///file:u.db?uri=true`` names the user's ``u.db`` (SQLAlchemy's SQLite driver
    opens the path as a ``file:`` URI), not a file called ``file:u.db``: refused in one line,
    ``u.db`` kept, no ``file:u.db`` made."""
    db = tmp_path / "u.db"
    _sql("CREATE TABLE notes (text TEXT)", "INSERT INTO notes VALUES ('mine')")(db, db)
    before = snapshot(tmp_path)
    url = ("--storage", f"sqlite:///file:u.db?{query}")
    for command in (
        ("run", "--model", "llama-7b", *SIM, "--budget", "5m", *url),
        ("best", *url),
        ("trials", *url),
        ("export", "--format", "deepspeed", *url),
    ):
        code, stderr = run_main(command, tmp_path, monkeypatch, capsys)
        line = one_line(stderr)
        assert code == 2 and "in SQLite's URI form (uri=true)" in line, (command, line)
        assert "give the file's path, sqlite:///path/to.db" in line
        assert snapshot(tmp_path) == before, command


@pytest.mark.parametrize(
    ("field", "value"), [("gpus", "8"), ("nodes", "2"), ("model_parallel", "2"), ("seq_len", 0.5)]
)
def test_a_study_planted_with_a_field_of_another_type_is_one_line(
    tmp_path: Path,
    optuna_db: Path,
    field: str,
    value: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A real study whose fingerprint says ``"gpus": "8"`` (a database written into by
    something else): every reader says which field in one line, exit 2 (every export was a
    ``TypeError`` traceback)."""
    db = tmp_path / "t.db"
    db.write_bytes(optuna_db.read_bytes())
    with contextlib.closing(sqlite3.connect(db)) as connection:
        [(text,)] = connection.execute(
            "SELECT value_json FROM study_user_attributes WHERE key = 'autotune_fingerprint'"
        ).fetchall()
        planted = {**json.loads(text), field: value}
        connection.execute(
            "UPDATE study_user_attributes SET value_json = ? WHERE key = 'autotune_fingerprint'",
            (json.dumps(planted),),
        )
        connection.commit()
    url = ("--storage", f"sqlite:///{db}")
    for command in (
        ("best", *url),
        ("trials", *url),
        ("export", "--format", "deepspeed", *url),
        ("report", "-o", "r.html", *url),
    ):
        code, stderr = run_main(command, tmp_path, monkeypatch, capsys)
        line = one_line(stderr)
        assert code == 2 and f"a study's {field} is {value!r}, not a whole number" in line, line


# ------------------------------------------------------------------ job files: aliases, hosts

ANCHORS = "anchors and aliases (&x, *x) are not read in job files: write the values out"


def _nested_aliases(levels: int) -> str:
    """A job file whose ``hosts:`` nests aliases ``levels`` deep: ten times as many names at
    each level (seven levels: ten million host names in about 550 bytes)."""
    lines = ["workloads:", "  - model: llama-7b", "    simulate: h100-80gb", "    hosts:"]
    lines.append("      - &l0 [" + ", ".join(["node"] * 10) + "]")
    lines += [f"      - &l{n} [" + ", ".join([f"*l{n - 1}"] * 10) + "]" for n in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (_nested_aliases(7), 5),
        ("base: &base {gpus: 8}\nworkloads:\n  - model: tiny\n", 1),
        ("workloads:\n  - model: &m tiny\n", 2),
        ("workloads:\n  - model: tiny\n    seq_len: 64\n  - model: tiny\n    gpus: *g\n", 5),
    ],
    ids=["nested aliases under hosts", "an anchor at the top", "an anchor alone", "an alias"],
)
def test_anchors_and_aliases_are_refused_before_any_value_is_built(
    tmp_path: Path, text: str, line: int
) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        read_jobs(path, {})
    assert str(refused.value) == f"{path}:{line}: {ANCHORS}"


def test_a_job_file_of_nested_aliases_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "nightly.yaml").write_text(_nested_aliases(7))
    before = snapshot(tmp_path)
    code, stderr = run_main(
        ("run", "--jobs", "nightly.yaml", "--storage", "sqlite:///t.db"), tmp_path, monkeypatch,
        capsys,
    )  # fmt: skip
    assert code == 2 and one_line(stderr) == f"error: nightly.yaml:5: {ANCHORS}"
    assert snapshot(tmp_path) == before


HEAD = "workloads:\n  - model: llama-7b\n    simulate: h100-80gb\n    hosts:"
BOUND_FILES: dict[str, tuple[str, str]] = {
    "a list nested 100,000 deep (200 KB)": (
        f"{HEAD} " + "[" * 100_000 + "]" * 100_000 + "\n",
        "nightly.yaml:4: lists and mappings nested more than 16 deep",
    ),
    "a list nested 40 deep in block style": (
        HEAD + "\n" + "".join(f"      {'  ' * d}-\n" for d in range(40)),
        "nightly.yaml:18: lists and mappings nested more than 16 deep",
    ),
    "8 MiB of workloads": (
        "workloads:\n" + "  - {model: llama-7b, simulate: h100-80gb}\n" * 200_000,
        "nightly.yaml is larger than a job file (8.20 MiB, where job files are at most "
        "256.0 KiB): split its workloads over several files",
    ),
    "3,000 workloads": (
        "workloads:\n" + "  - {model: llama-7b, simulate: h100-80gb}\n" * 3_000,
        "nightly.yaml:2: 3,000 workloads, where a job file holds at most 256",
    ),
}
"""Job files past the bounds of one (its size, its nesting, its workloads), each refused in
one line before it is parsed further: they took 42 s to minutes, or ended in a traceback of
Python's recursion."""


@pytest.mark.parametrize("kind", BOUND_FILES)
def test_a_job_file_past_a_job_files_bounds_is_one_line(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text, says = BOUND_FILES[kind]
    (tmp_path / "nightly.yaml").write_text(text)
    before = snapshot(tmp_path)
    code, stderr = run_main(
        ("run", "--jobs", "nightly.yaml", "--storage", "sqlite:///t.db"), tmp_path, monkeypatch,
        capsys,
    )  # fmt: skip
    assert code == 2 and one_line(stderr).startswith(f"error: {says}"), one_line(stderr)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("hosts", "says"),
    [
        ("[localhost, [node2, node3]]", "hosts must be host names, like [this-host, node2]"),
        ("[localhost, 7]", "hosts must be host names, like [this-host, node2], not ['local"),
        ("localhost,-oProxyCommand=touch pwned", "'-oProxyCommand=touch pwned' is not a host name"),
        ("[localhost, 'a;b']", "'a;b' is not a host name"),
    ],
)  # fmt: skip
def test_hosts_is_a_list_of_host_names_checked_as_hosts_is(
    tmp_path: Path, hosts: str, says: str
) -> None:
    path = tmp_path / "nightly.yaml"
    path.write_text(f"workloads:\n  - model: tiny\n    hosts: {hosts}\n")
    with pytest.raises(ConfigError) as refused:
        read_jobs(path, {})
    assert str(refused.value).startswith(f"{path}:3: workload 1: {says}"), refused.value


# ------------------------------------------------------------------ the whole job file first

GOOD = "  - model: qwen2.5-1.5b\n    simulate: h100-80gb\n    budget: 2m\n"
"""A workload that tunes at once (the simulated GPU)."""

BAD_WORKLOADS: dict[str, tuple[str, str]] = {
    "hosts": (
        "simulate: h100-80gb\n    hosts: [localhost, node2]",
        "--hosts places real probes: leave it out with --simulate",
    ),
    "storage (a bare path)": (
        "simulate: h100-80gb\n    storage: other.db",
        "'other.db' is not a storage URL: use sqlite:///other.db",
    ),
    "storage (another program's SQLite file)": (
        "simulate: h100-80gb\n    storage: sqlite:///invoices.db",
        "invoices.db is a SQLite database of something else (table 'invoices')",
    ),
    "global_batch": (
        "simulate: h100-80gb\n    global_batch: 10000000000",
        "more sequences per step than any training run takes",
    ),
    "seq_len": (
        "simulate: h100-80gb\n    seq_len: 8192",
        "--seq-len 8192 is longer than llama-7b takes (4096 positions",
    ),
    "lora_rank": ("simulate: h100-80gb\n    lora_rank: 0", "--lora-rank 0: use 1 or more"),
    "ddp on one GPU": (
        "simulate: h100-80gb\n    engine: ddp\n    gpus: 1",
        "--engine ddp leaves no configuration on 1 GPU",
    ),
    "nodes": (
        "device: cpu\n    device_memory: 64MiB\n    nodes: 2",
        "--nodes 2 needs the hosts",
    ),
    "an indivisible batch": (
        "simulate: h100-80gb\n    global_batch: 63",
        "global batch 63 is not a multiple of 8 GPUs",
    ),
    "mfu on the CPU": (
        "device: cpu\n    device_memory: 64MiB\n    objective: mfu",
        "--objective mfu needs a GPU's peak FLOP/s",
    ),
    "device_memory": (
        "simulate: h100-80gb\n    device_memory: 200GiB",
        "--device-memory 200.0 GiB is more than the h100-80gb's",
    ),
    "gpus": ("device: cpu\n    device_memory: 64MiB\n    gpus: 64", "--gpus 64 on the CPU"),
    "trials_dir": (
        "simulate: h100-80gb\n    trials_dir: afile/probes",
        "no probe folder can be made in afile/probes (Not a directory): a file is in the way",
    ),
}


@pytest.mark.parametrize("field", BAD_WORKLOADS)
def test_a_bad_third_workload_stops_the_job_before_the_first_is_tuned(
    tmp_path: Path,
    field: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fields, says = BAD_WORKLOADS[field]
    model = "tiny" if "device: cpu" in fields else "llama-7b"
    (tmp_path / "nightly.yaml").write_text(
        f"workloads:\n{GOOD}{GOOD}  - model: {model}\n    {fields}\n"
    )
    _sql("CREATE TABLE invoices (id INTEGER, total REAL)")(tmp_path / "invoices.db", tmp_path)
    (tmp_path / "afile").write_text("a file where a folder would go\n")
    before = snapshot(tmp_path)
    code, stderr = run_main(
        ("run", "--jobs", "nightly.yaml", "--storage", "sqlite:///t.db"),
        tmp_path, monkeypatch, capsys,
    )  # fmt: skip
    line = one_line(stderr)
    assert code == 2 and line.startswith("error: nightly.yaml:8: workload 3: "), line
    assert says in line, line
    assert not (tmp_path / "t.db").exists()  # workload 1 was not tuned: no study, no trial
    assert not (tmp_path / "trials").exists()
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------ names are the whole text


@pytest.mark.parametrize("host", ["node2\n", "localhost\n", "node2\nProxyCommand=x"])
def test_a_host_name_with_a_line_break_is_no_host_name(host: str) -> None:
    with pytest.raises(ConfigError, match="is not a host name"):
        check_host(host)
    with pytest.raises(ConfigError, match="is not a host name"):
        nodes_from_environment({}, nodes=None, hosts=["localhost", host])


def test_a_probe_folder_name_with_a_line_break_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, stderr = run_main(
        ("probe", "--model", "tiny", "--device", "cpu", "--study", "s1\n"),
        tmp_path, monkeypatch, capsys,
    )  # fmt: skip
    assert code == 2 and "--study 's1\\n' is not a folder name" in one_line(stderr)
    assert list(tmp_path.iterdir()) == []
