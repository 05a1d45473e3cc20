"""The trial database under faults (SQLite): one line, a non-zero exit, and never a changed,
half-written or corrupted study.

The faults are real: a file of random bytes, a truncated database, another program's
database, a process holding an exclusive lock, a read-only file system and a full one (small
tmpfs mounts, which need root: skipped otherwise). The workload is the simulated GPU, whose
probes take no time, so each run is a second or two.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgserver import PostgresServer

from autotune.config import ConfigError, TrainConfig
from autotune.devices import SimulatedDevice
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec
from autotune.study.fingerprint import Fingerprint
from autotune.study.reader import read_studies
from autotune.study.store import (
    CONNECT_ATTEMPTS,
    STORAGE_ERRORS,
    TrialStore,
    open_storage,
    storage_problem,
)
from tests.shared_study import LLAMA_H100_RUN, FinishedRun, finished_run
from tests.test_cli import autotune

RUN = LLAMA_H100_RUN  # llama-7b on a simulated H100 node, 30 minutes of its clock


@pytest.fixture(scope="session")
def finished(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """``RUN`` to its end (the search done), made once per session: the tests that fault a
    finished study each start from a copy of its database."""
    return finished_run(tmp_path_factory, *RUN)


def _line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def _states(db: Path) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as connection:
        assert connection.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return dict(connection.execute("SELECT state, COUNT(*) FROM trials GROUP BY state"))


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small file system of its own at ``path`` (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize(
    "kind", ["random bytes", "truncated", "another program's", "named like Optuna's"]
)
def test_a_file_that_is_no_trial_database_is_refused_and_kept(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    db = tmp_path / "t.db"
    if kind == "random bytes":
        db.write_bytes(os.urandom(8192))
    elif kind == "truncated":  # a finished study's database, cut to its first third
        finished: FinishedRun = request.getfixturevalue("finished")
        finished.copy_database(db)
        db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    elif kind == "another program's":
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute("CREATE TABLE invoices (id INTEGER, total REAL)")
            connection.execute("INSERT INTO invoices VALUES (1, 9.5)")
            connection.commit()
    else:  # a school's database: its tables are named as two of Optuna's, their columns not
        with contextlib.closing(sqlite3.connect(db)) as connection:
            connection.execute("CREATE TABLE studies (id INTEGER, subject TEXT)")
            connection.execute("CREATE TABLE trials (id INTEGER, study INTEGER, score REAL)")
            connection.execute("INSERT INTO studies VALUES (1, 'chemistry')")
            connection.commit()
    before = db.read_bytes()
    for command in (RUN, ("best",), ("trials",)):
        done = autotune(*command, "--storage", f"sqlite:///{db}", cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        line = _line(done.stderr)
        assert str(db) in line and ("something else" in line or "not a database" in line
                                    or "malformed" in line), line  # fmt: skip
        assert db.read_bytes() == before, command  # never repaired, migrated or overwritten
    assert [p.name for p in tmp_path.iterdir()] == ["t.db"] or kind == "truncated"


def test_reading_commands_write_nothing_into_an_empty_or_new_database(tmp_path: Path) -> None:
    """``best`` and ``trials`` on a 0-byte file or a database with no table find no study
    (they say so, exit 2) and leave the file as it was: a reading command creates no table."""
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    bare = tmp_path / "bare.db"
    with contextlib.closing(sqlite3.connect(bare)) as connection:
        connection.execute("PRAGMA user_version = 7")  # a database file with no table
        connection.commit()
    for db in (empty, bare):
        before = db.read_bytes()
        for command in ("best", "trials"):
            done = autotune(command, "--storage", f"sqlite:///{db}", cwd=tmp_path)
            assert done.returncode == 2 and "no autotune study in" in _line(done.stderr)
            assert db.read_bytes() == before, (db.name, command)
        assert read_studies(f"sqlite:///{db}?timeout=5") == []  # through Optuna, read-only
        assert db.read_bytes() == before


def test_a_database_locked_too_long_is_a_bounded_wait_then_one_line(
    tmp_path: Path, finished: FinishedRun
) -> None:
    db = finished.copy_database(tmp_path / "t.db")  # a finished RUN's study
    before = _states(db)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], "
         "isolation_level=None); c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); "
         "time.sleep(60)", str(db)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        done = autotune(*RUN, "--gpus", "4", "--storage", f"sqlite:///{db}", cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2, done.stderr
    line = _line(done.stderr)
    assert "database is locked" in line and "another process holds it" in line
    assert "PostgreSQL" in line
    assert _states(db) == before


def test_a_read_only_database_is_refused_and_still_read(
    tmp_path: Path, finished: FinishedRun
) -> None:
    with _tmpfs(tmp_path / "ro", "2m") as folder:
        db = finished.copy_database(folder / "t.db")  # a finished RUN's study
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        for more in ((), ("--gpus", "4")):  # the same study, and a new one
            refused = autotune(*RUN, *more, "--storage", f"sqlite:///{db}", cwd=tmp_path)
            assert refused.returncode == 2, refused.stderr
            assert "it cannot be written here" in _line(refused.stderr)
        best = autotune("best", "--json", "--storage", f"sqlite:///{db}", cwd=tmp_path)
        assert best.returncode == 0 and '"best"' in best.stdout  # reading needs no write


def test_a_full_disk_stops_the_run_with_its_trials_intact_and_the_next_run_goes_on(
    tmp_path: Path,
) -> None:
    """The database fills its file system in the middle of a run: the run stops with one
    reason and exit 1, the trials recorded before are whole, a claim cut short is taken back,
    and once there is room the next run finishes the search without a trial left running."""
    with _tmpfs(tmp_path / "small", "160k") as folder:
        db = folder / "t.db"
        args = (*RUN, "--storage", f"sqlite:///{db}", "--trials-dir", str(tmp_path / "trials"))
        full = autotune(*args, "--json", cwd=tmp_path)
        assert full.returncode == 1, full.stderr
        assert '"failure": "database or disk is full"' in full.stdout
        assert "Traceback" not in full.stderr
        kept = _states(db)
        assert kept.get("COMPLETE", 0) > 0 and "RUNNING" not in kept
        subprocess.run(["mount", "-o", "remount,size=4m", str(folder)], check=True)
        again = autotune(*args, "--json", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        after = _states(db)
        # PRUNED: a claim the full disk cut short, taken back (withdrawn, counted nowhere).
        assert after["COMPLETE"] > kept["COMPLETE"]
        assert set(after) <= {"COMPLETE", "FAIL", "PRUNED"}


def test_two_tuners_on_one_sqlite_file_share_the_study_safely(tmp_path: Path) -> None:
    """SQLite serializes writers with its file lock and every claim is one transaction, so
    two tuner processes on one file are safe (PostgreSQL is for many workers and nodes): both
    finish, no point is measured twice, nothing is left running. The second tuner's live log
    numbers only the probes it ran: a point lost to the other tuner is not shown as a probe."""
    db = tmp_path / "t.db"
    args = [*RUN, "--gpus", "8", "--storage", f"sqlite:///{db}"]
    tuners = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from autotune.cli import main; main()",
                *args,
                *(("--json",) if n == 0 else ()),
                "--trials-dir",
                str(tmp_path / f"w{n}"),
            ],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outputs = [tuner.communicate(timeout=240) for tuner in tuners]
    for tuner, (_, err) in zip(tuners, outputs, strict=True):
        assert tuner.returncode == 0, err
    assert json.loads(outputs[0][0])["probes"] >= 0
    log = outputs[1][0]
    numbers = [int(n) for n in re.findall(r"^probe (\d+): ", log, flags=re.MULTILINE)]
    ran = int(re.findall(r"; (\d+) probes? this run", log)[-1])
    assert numbers == list(range(1, ran + 1)), log  # each a probe it ran, numbered once
    [study] = read_studies(f"sqlite:///{db}")
    complete = [m for m in study.measurements if m.state == "COMPLETE"]
    points = Counter((*m.key, m.repeat) for m in complete)
    assert complete and max(points.values()) == 1, points  # no point measured twice
    assert "RUNNING" not in _states(db)


# ------------------------------------------------------------------ PostgreSQL, lost and back


def _simulated_probe(tmp_path: Path, config: TrainConfig) -> ProbeResult:
    """A probe of llama-7b on 8 simulated H100s (the estimator answers at once)."""
    spec = ProbeSpec(
        model="llama-7b", config=config, micro_batch_sizes=(1, 2), seq_len=4096,
        num_processes=8, device="cuda",
    )  # fmt: skip
    return SimulatedDevice.named("h100-80gb").launch(spec, tmp_path / "probe")


def _fingerprint() -> Fingerprint:
    return Fingerprint(
        model="llama-7b", seq_len=4096, global_batch=512, gpu="h100-80gb",
        gpu_memory_bytes=80 << 30, gpus=8, device="simulated",
    )  # fmt: skip


def test_a_server_unreachable_at_the_start_is_tried_with_backoff_then_one_line() -> None:
    url = f"postgresql+psycopg://tuner:{'s3cret'}@127.0.0.1:1/autotune"  # nothing listens
    with pytest.raises(ConfigError) as refused:
        open_storage(url)
    message = str(refused.value)
    assert "tuner:***@127.0.0.1:1" in message and "s3cret" not in message
    assert "Connection refused" in message
    assert f"({CONNECT_ATTEMPTS} tries over {2 ** (CONNECT_ATTEMPTS - 1) - 1} s)" in message


def test_a_probe_finished_while_the_server_was_down_is_recorded_when_it_is_back(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """The server stops after a probe was claimed and comes back 3 s later: the result is
    written then, through a new connection, once."""
    url = postgres_server.create_database("outage_back")
    store = TrialStore(_fingerprint(), storage=url)
    config = TrainConfig(engine="fsdp", zero_stage=3)
    claimed = store.claim(config, [1, 2])
    assert claimed is not None
    result = _simulated_probe(tmp_path, config)
    postgres_server.pause()
    back = threading.Timer(3.0, postgres_server.resume)
    back.start()
    try:
        store.record(claimed, result)  # waits out the outage
    finally:
        back.join()
    states = Counter(m.state for m in store.measurements())
    assert states == Counter({"COMPLETE": 2})


def test_a_server_gone_past_the_retry_window_stops_the_call_and_loses_nothing(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """Past the window the write gives up (the run then stops with the reason); the claimed
    trials stay RUNNING, so the next run fails them as stale and probes their points again."""
    url = postgres_server.create_database("outage_gone")
    store = TrialStore(_fingerprint(), storage=url)
    store.retry_window_s = 2.0
    config = TrainConfig(engine="fsdp", zero_stage=2)
    claimed = store.claim(config, [1])
    assert claimed is not None
    result = _simulated_probe(tmp_path, config)
    postgres_server.pause()
    try:
        with pytest.raises(STORAGE_ERRORS) as gave_up:
            store.record(claimed, result)
        assert "connect" in storage_problem(gave_up.value).lower()
    finally:
        postgres_server.resume()
    [kept] = TrialStore(_fingerprint(), storage=url).measurements()
    assert kept.state == "RUNNING"  # visible to the next run: retried, never lost silently


def test_a_full_disk_leaves_no_empty_database_and_no_empty_output_file(
    tmp_path: Path, finished: FinishedRun
) -> None:
    """On a full file system: ``run`` with a new database there refuses with one line and
    leaves no 0-byte ``.db``; ``export -o`` and ``report -o`` (of a finished study elsewhere)
    refuse with one line and leave no empty file, so that once there is room the same
    commands write it (no "exists")."""
    study = f"sqlite:///{finished.copy_database(tmp_path / 'study.db')}"
    with _tmpfs(tmp_path / "full", "16m") as folder:
        with (folder / "filler").open("wb") as filler, pytest.raises(OSError):
            filler.write(b"x" * (32 << 20))
            filler.flush()
        refused = autotune(*RUN, "--storage", f"sqlite:///{folder / 't.db'}", cwd=tmp_path)
        assert refused.returncode == 2 and "full" in _line(refused.stderr)
        outputs = (
            ("export", "--format", "accelerate", "-o", str(folder / "accelerate.yaml")),
            ("report", "-o", str(folder / "report.html")),
        )
        for command in outputs:
            failed = autotune(*command, "--storage", study, cwd=tmp_path)
            assert failed.returncode == 2, failed.stderr
            assert "No space left on device" in _line(failed.stderr)
        assert sorted(p.name for p in folder.iterdir()) == ["filler"]
        (folder / "filler").unlink()
        for command in outputs:
            written = autotune(*command, "--storage", study, cwd=tmp_path)
            assert written.returncode == 0, written.stderr
        assert sorted(p.name for p in folder.iterdir()) == ["accelerate.yaml", "report.html"]
        assert "distributed_type" in (folder / "accelerate.yaml").read_text()


def test_a_database_deleted_or_replaced_under_a_store_is_said_so(tmp_path: Path) -> None:
    """What a run says when its SQLite file goes: the store sees that its file was deleted or
    replaced (not "the trials recorded before are kept")."""
    db = tmp_path / "t.db"
    fingerprint = Fingerprint(
        model="tiny", seq_len=32, global_batch=4, gpu="cpu", gpu_memory_bytes=1 << 30, gpus=1
    )
    store = TrialStore(fingerprint, storage=f"sqlite:///{db}")
    assert store.lost_file() is None
    db.rename(tmp_path / "moved.db")
    assert store.lost_file() == f"{db} was deleted while the run went on"
    db.write_bytes(b"")
    assert store.lost_file() == f"{db} was replaced while the run went on"
