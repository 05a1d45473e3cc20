"""The read-only reader (``autotune best``, ``trials``, launchers) against Optuna's own view of
the same database: every trial decoded alike, on SQLite here and on PostgreSQL in
``test_postgres.py``; other schema revisions go through Optuna; nothing is created."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import sqlalchemy

from autotune.config import ConfigError, TrainConfig
from autotune.study import TrialStore
from autotune.study import reader as reader_module
from autotune.study.reader import read_studies

from .test_store import _fingerprint, _probe


def check_reader_matches_optuna(url: str, tmp_path: Path) -> None:
    """A study with every kind of trial (ok, measured and inferred OOMs, a repeat, a claim in
    flight, withdrawn claims, an interruption), a second empty study and a foreign Optuna
    study: the reader's decoding equals the store's, trial for trial."""
    store = TrialStore(_fingerprint(), storage=url)
    fsdp = TrainConfig(engine="fsdp", zero_stage=3)
    _probe(store, tmp_path, fsdp, (1, 2, 4, 8))
    _probe(store, tmp_path, fsdp, (2,), repeat=1)
    store.ask(TrainConfig(engine="deepspeed", zero_stage=2, offload="optimizer"), 4)  # running
    other = TrialStore(_fingerprint(), storage=url)
    assert other.claim(fsdp, [2]) is None  # measured already: withdrawn, and hidden
    cut = store.claim(TrainConfig(engine="deepspeed", zero_stage=1, ac_every=1), [2, 4])
    assert cut is not None
    store.interrupt(cut, tmp_path / "cut", "interrupted")
    TrialStore(_fingerprint(gpus=16), storage=url)  # a second study, with no trials yet
    optuna.create_study(storage=store.storage, study_name="not-autotune").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2
    )

    read = read_studies(url)
    through_optuna = TrialStore.existing(url)
    assert [s.study_name for s in read] == [s.fingerprint.study_name for s in through_optuna]
    assert [s.study_name for s in read] == [
        _fingerprint().study_name,
        _fingerprint(gpus=16).study_name,
    ]
    for fast, slow in zip(read, through_optuna, strict=True):
        assert fast.fingerprint == slow.fingerprint
        assert fast.measurements == slow.measurements()
        assert fast.best == slow.best()
    measurements = read[0].measurements
    states = sorted({(m.state, m.outcome) for m in measurements}, key=str)
    assert states == sorted(
        {("COMPLETE", "ok"), ("COMPLETE", "oom"), ("RUNNING", None), ("FAIL", "interrupted")},
        key=str,
    )
    assert any(m.repeat == 1 for m in measurements)
    assert any(m.config.offload.value == "optimizer" for m in measurements)  # choices decoded
    assert read[0].best is not None and read[0].best.repeats == 2
    assert read[1].measurements == [] and read[1].best is None


def test_the_reader_matches_optuna_on_sqlite(tmp_path: Path) -> None:
    check_reader_matches_optuna(f"sqlite:///{tmp_path}/a.db", tmp_path)


def test_another_schema_revision_is_read_through_optuna(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2))
    expected = store.measurements()
    with sqlite3.connect(tmp_path / "a.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'v9.9.9.z'")
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as connection:
        assert reader_module._read(connection) is None  # not a schema the reader knows
    engine.dispose()
    [study] = read_studies(url)
    assert study.measurements == expected


def test_a_sqlite_url_with_options_is_read_too(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2))
    [plain] = read_studies(url)
    [with_options] = read_studies(url + "?timeout=30")
    assert with_options == plain and plain.measurements == store.measurements()


def test_a_missing_file_holds_no_study_and_is_not_created(tmp_path: Path) -> None:
    assert read_studies(f"sqlite:///{tmp_path}/none/autotune.db") == []
    assert not (tmp_path / "none").exists()


def test_a_database_without_optuna_tables_holds_no_study(tmp_path: Path) -> None:
    sqlite3.connect(tmp_path / "empty.db").close()
    assert read_studies(f"sqlite:///{tmp_path}/empty.db") == []


def test_a_storage_that_cannot_be_opened_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "notes.db").write_text("not a database\n" * 100)
    for url in ("mysql+nodriver://host/db", f"sqlite:///{tmp_path}/notes.db"):
        with pytest.raises(ConfigError, match="cannot open trial storage") as error:
            read_studies(url)
        assert "\n" not in str(error.value) and "sqlite:///path/to.db" in str(error.value)
    assert (tmp_path / "notes.db").read_text().startswith("not a database")  # left as it was


def test_reading_studies_back_loads_neither_optuna_nor_torch(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2))
    code = f"""
import json, sys
import autotune
[study] = autotune.best(storage={url!r})
assert study.best is not None and study.best.micro_batch_size == 2
heavy = ("optuna", "alembic", "torch", "transformers", "deepspeed")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
