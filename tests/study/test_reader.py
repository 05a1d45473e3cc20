"""The read-only reader (``autotune best``, ``trials``, launchers) against Optuna's own view of
the same database: every trial decoded alike, the best point and the last trials alike when
only those are decoded, on SQLite here and on PostgreSQL in ``test_postgres.py``; other schema
revisions go through Optuna; nothing is created."""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy

from autotune.config import ConfigError, TrainConfig
from autotune.study import Fingerprint, TrialStore
from autotune.study import reader as reader_module
from autotune.study.measurement import Measurement, decode, point
from autotune.study.reader import read_studies
from autotune.study.store import stored

from .test_store import _fingerprint, _probe

LASTS = (None, 0, 1, 2, 3, 10_000)
"""How many of each study's last trials to decode (None: every one)."""


def _every_kind_of_trial(url: str, tmp_path: Path) -> TrialStore:
    """A study with every kind of trial (ok, measured and inferred OOMs, a repeat, a point
    whose repeat ran out of memory, a claim in flight, withdrawn claims, an interruption), a
    second study with trials of its own, an empty one and a foreign Optuna study."""
    store = TrialStore(_fingerprint(), storage=url)
    fsdp = TrainConfig(engine="fsdp", zero_stage=3)
    _probe(store, tmp_path, fsdp, (1, 2, 4, 8))
    _probe(store, tmp_path, fsdp, (2,), repeat=1)
    ddp = TrainConfig(engine="ddp", ac_every=1)
    _probe(store, tmp_path, ddp, (1,))
    peak = next(m.peak_bytes for m in store.measurements() if m.key == (ddp, 1))
    _probe(store, tmp_path, ddp, (1,), repeat=1, device_memory_bytes=(peak or 2) - 1)  # OOM
    store.ask(TrainConfig(engine="deepspeed", zero_stage=2, offload="optimizer"), 4)  # running
    other = TrialStore(_fingerprint(), storage=url)
    assert other.claim(fsdp, [2]) is None  # measured already: withdrawn, and hidden
    cut = store.claim(TrainConfig(engine="deepspeed", zero_stage=1, ac_every=1), [2, 4])
    assert cut is not None
    store.interrupt(cut, tmp_path / "cut", "interrupted")
    second = TrialStore(_fingerprint(gpus=16), storage=url)
    _probe(second, tmp_path, TrainConfig(engine="fsdp", zero_stage=2), (1, 2))
    TrialStore(_fingerprint(gpus=32), storage=url)  # a third study, with no trials yet
    optuna.create_study(storage=store.storage, study_name="not-autotune").optimize(
        lambda t: t.suggest_float("x", 0, 1), n_trials=2
    )
    return store


def check_same_as_through_optuna(url: str) -> list[OptunaView]:
    """Every study read by the reader equals the same study read through Optuna, whether
    every trial is decoded or only the last few: the trials shown, their count, and the best
    point with every attribute of its latest trial."""
    through_optuna = TrialStore.existing(url)
    assert through_optuna
    views = [optuna_view(slow) for slow in through_optuna]  # read once: nothing writes here
    for last, best in itertools.product(LASTS, (True, False)):
        read = read_studies(url, last=last, best=best)
        assert [s.fingerprint for s in read] == [v.fingerprint for v in views]
        for fast, view in zip(read, views, strict=True):
            every = view.measurements
            expected = every
            if last is not None:
                expected = sorted(every, key=lambda m: m.number)[max(len(every) - last, 0) :]
            assert fast.measurements == expected, (last, best)
            assert fast.trial_count == len(every)
            assert fast.best == (view.best if best else None), (last, best)
            assert fast.updated == view.updated  # the newest trial's end, as Optuna reads it
    return views


@dataclass(frozen=True)
class OptunaView:
    """A study as :class:`TrialStore` reads it through Optuna's API: its fingerprint, every
    trial decoded, the best point, and its newest trial's end."""

    fingerprint: Fingerprint
    measurements: list[Measurement]
    best: Measurement | None
    updated: dt.datetime | None


def optuna_view(store: TrialStore) -> OptunaView:
    return OptunaView(store.fingerprint, store.measurements(), store.best(), store.updated())


def check_reader_matches_optuna(url: str, tmp_path: Path) -> None:
    """The reader's decoding equals the store's, trial for trial, on every kind of trial."""
    _every_kind_of_trial(url, tmp_path)
    check_same_as_through_optuna(url)
    read = read_studies(url)
    assert [s.study_name for s in read] == [
        _fingerprint().study_name,
        _fingerprint(gpus=16).study_name,
        _fingerprint(gpus=32).study_name,
    ]
    measurements = read[0].measurements
    states = sorted({(m.state, m.outcome) for m in measurements}, key=str)
    assert states == sorted(
        {("COMPLETE", "ok"), ("COMPLETE", "oom"), ("RUNNING", None), ("FAIL", "interrupted")},
        key=str,
    )
    assert any(m.repeat == 1 for m in measurements)
    assert any(m.config.offload.value == "optimizer" for m in measurements)  # choices decoded
    best = read[0].best
    assert best is not None and best.repeats == 2 and best.config.engine.value == "fsdp"
    # Its latest trial is not among the last ones shown: read again with every attribute.
    [shown] = read_studies(url, last=1)[0].measurements
    assert shown.number > best.number and read_studies(url, last=1)[0].best == best
    assert best.probe_dir and best.attrs["probe_dir"] == best.probe_dir
    assert best.attrs["repeats"] == 2 and "device" in best.attrs
    assert read[1].best is not None and read[1].trial_count == 2
    assert read[2].measurements == [] and read[2].best is None and read[2].trial_count == 0
    assert read[0].updated is not None and read[2].updated is None


def test_the_reader_matches_optuna_on_sqlite(tmp_path: Path) -> None:
    check_reader_matches_optuna(f"sqlite:///{tmp_path}/a.db", tmp_path)


def test_a_point_is_what_pooling_reads_of_a_measurement(tmp_path: Path) -> None:
    store = _every_kind_of_trial(f"sqlite:///{tmp_path}/a.db", tmp_path)
    trials = [t for t in store.study.get_trials() if "micro_batch_size" in t.params]
    assert {t.state.name for t in trials} == {"COMPLETE", "RUNNING", "FAIL", "PRUNED"}
    feasible = set()
    for trial in trials:
        fields = stored(trial)
        m = decode(fields)
        light = point(fields)
        assert light == (m.number, m.key, m.state, m.feasible, m.value, m.tokens_per_second, m.mfu)
        feasible.add(light.feasible)
    assert feasible == {True, False}


_COPIED = {
    "trial_params": "param_name, param_value, distribution_json",
    "trial_values": "objective, value, value_type",
    "trial_user_attributes": "key, value_json",
    "trial_system_attributes": "key, value_json",
}


def _grow(url: str, trials: int) -> None:
    """Every trial of the database added again, renumbered after the last, until it holds
    ``trials`` trials: as Optuna stores them, through SQL (Optuna's API takes minutes). Each
    trial's objective is then nudged by a part in 10 million per trial id."""
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as db:
        ids = [i for (i,) in db.execute(sqlalchemy.text("SELECT trial_id FROM trials"))]
        count = len(ids)
        while count < trials:
            top_id, top_number = db.execute(
                sqlalchemy.text("SELECT MAX(trial_id), MAX(number) FROM trials")
            ).one()
            batch = ids[: trials - count]
            chosen = sqlalchemy.bindparam("batch", expanding=True)
            values = {"batch": batch, "top_id": top_id, "after": top_number + 1}
            db.execute(
                sqlalchemy.text(
                    "INSERT INTO trials (trial_id, number, study_id, state, datetime_start, "
                    "datetime_complete) SELECT trial_id + :top_id, number + :after, study_id, "
                    "state, datetime_start, datetime_complete FROM trials "
                    "WHERE trial_id IN :batch"
                ).bindparams(chosen),
                values,
            )
            for table, columns in _COPIED.items():
                db.execute(
                    sqlalchemy.text(
                        f"INSERT INTO {table} (trial_id, {columns}) SELECT trial_id + :top_id, "
                        f"{columns} FROM {table} WHERE trial_id IN :batch"
                    ).bindparams(chosen),
                    values,
                )
            count += len(batch)
        # Each copy's objective a little off its original's, as a re-measurement's would be:
        # a point's mean then depends on the order its measurements are added in.
        db.execute(sqlalchemy.text("UPDATE trial_values SET value = value * (1 + trial_id * 1e-7)"))
    engine.dispose()


def _cli(*args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def check_a_grown_study_reads_as_through_optuna(url: str, tmp_path: Path) -> None:
    """A study of 1,200 trials (every kind, its points measured hundreds of times): the
    reader, ``autotune best`` and ``autotune trials --last N`` answer as Optuna's view does,
    also when more trials are shown than one query names (500)."""
    _every_kind_of_trial(url, tmp_path)
    _grow(url, 1200)
    views = check_same_as_through_optuna(url)
    for last, best in itertools.product((499, 500, 501, 700), (True, False)):
        for fast, view in zip(read_studies(url, last=last, best=best), views, strict=True):
            every = sorted(view.measurements, key=lambda m: m.number)
            assert fast.measurements == every[-last:]
            assert fast.best == (view.best if best else None)
    top = views[0].best
    assert top is not None and top.repeats > 100
    expected_best = [
        {
            "study": view.fingerprint.study_name,
            "fingerprint": view.fingerprint.to_dict(),
            "trials": len(view.measurements),
            "best": view.best.to_dict() if view.best else None,
        }
        for view in views
    ]
    assert _cli("best", "--storage", url) == json.loads(json.dumps(expected_best, default=str))
    expected_trials = [
        {
            "study": view.fingerprint.study_name,
            "trials": [m.to_dict() for m in sorted(view.measurements, key=lambda m: m.number)[-7:]],
        }
        for view in views
    ]
    listed = _cli("trials", "--storage", url, "--last", "7")
    assert listed == json.loads(json.dumps(expected_trials, default=str))
    assert [len(s["trials"]) for s in listed] == [7, 7, 0]


def test_a_grown_study_reads_as_through_optuna_on_sqlite(tmp_path: Path) -> None:
    check_a_grown_study_reads_as_through_optuna(f"sqlite:///{tmp_path}/a.db", tmp_path)


def test_another_schema_revision_is_read_through_optuna(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2))
    expected = store.measurements()
    with sqlite3.connect(tmp_path / "a.db") as db:
        db.execute("UPDATE alembic_version SET version_num = 'v9.9.9.z'")
    with contextlib.closing(sqlite3.connect(tmp_path / "a.db")) as db:
        # not a schema the reader knows
        assert reader_module._read(lambda query: db.execute(query).fetchall(), None, True) is None
    [study] = read_studies(url)
    assert study.measurements == expected
    [latest] = read_studies(url, last=1)
    assert latest.measurements == expected[-1:] and latest.trial_count == 2
    assert latest.best == study.best == store.best()
    [unpooled] = read_studies(url, last=1, best=False)
    assert unpooled.measurements == expected[-1:] and unpooled.best is None


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


def test_reading_a_sqlite_file_loads_neither_optuna_sqlalchemy_nor_torch(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/a.db"
    store = TrialStore(_fingerprint(), storage=url)
    _probe(store, tmp_path, TrainConfig(engine="fsdp", zero_stage=3), (1, 2))
    code = f"""
import json, sys
import autotune
[study] = autotune.best(storage={url!r}, last=0)
assert study.best is not None and study.best.micro_batch_size == 2
assert study.trial_count == 2 and study.measurements == []
heavy = ("optuna", "alembic", "sqlalchemy", "torch", "transformers", "deepspeed")
print(json.dumps(sorted(m for m in heavy if m in sys.modules)))
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_a_negative_number_of_trials_to_show_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="use 0 or more"):
        read_studies(f"sqlite:///{tmp_path}/a.db", last=-1)


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_a_trial_whose_tuner_stopped_heartbeating_reads_as_stale(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``autotune trials`` on a study where a tuner died mid-probe: its RUNNING trial reads
    as ``stale`` once its heartbeat is older than the grace period (by the database's own
    clock), while a live tuner's trial, just beaten, still reads as running."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path}/a.db"
    else:
        url = request.getfixturevalue("fresh_postgres_url")
    store = TrialStore(_fingerprint(), storage=url)
    dead = store.ask(TrainConfig(engine="fsdp", zero_stage=3), 1)
    alive = store.ask(TrainConfig(engine="fsdp", zero_stage=3), 2)
    store.beat([dead, alive])
    engine = sqlalchemy.create_engine(url)
    minutes_ago = (
        "datetime('now', '-10 minutes')"
        if kind == "sqlite"
        else "LOCALTIMESTAMP - INTERVAL '10 minutes'"
    )
    with engine.begin() as connection:
        for table, column in (("trial_heartbeats", "heartbeat"), ("trials", "datetime_start")):
            connection.execute(
                sqlalchemy.text(
                    f"UPDATE {table} SET {column} = {minutes_ago} WHERE trial_id = :id"
                ),
                {"id": dead._trial_id},
            )
    engine.dispose()
    [study] = read_studies(url)
    by_number = {m.number: m for m in study.measurements}
    assert by_number[dead.number].state == "RUNNING"
    assert by_number[dead.number].outcome == "stale"
    assert "no heartbeat from its tuner for 10m" in (by_number[dead.number].message or "")
    assert by_number[alive.number].outcome is None  # its tuner is alive
    [latest] = read_studies(url, last=2)
    assert {m.outcome for m in latest.measurements} == {"stale", None}
