"""The trial database on a real PostgreSQL server: the store, claims, stale trials, the CLI,
and several tuner workers at once.

The server is private to the test session (``conftest.py``, ``tests/pgserver.py``); every
test gets an empty database of its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState
from pgserver import PostgresServer

from autotune.config import ConfigError, TrainConfig
from autotune.study import TrialStore, open_storage
from autotune.study import store as store_module

from .test_reader import check_a_grown_study_reads_as_through_optuna, check_reader_matches_optuna
from .test_store import (
    WORK,
    _fingerprint,
    check_claims_never_overlap,
    check_dead_tuner_trials_fail_at_once,
    check_probes_become_trials,
)

ROOT = Path(__file__).parents[2]
RUN_ARGS = (
    "run", "--model", "llama-7b", "--simulate", "h100-80gb", "--gpus", "8",
    "--seq-len", "4096", "--global-batch", "512", "--budget", "30m", "--json",
)  # fmt: skip
CLI_TIMEOUT_S = 300


def _cli(*args: str) -> list[str]:
    """The real console entry point in a fresh interpreter."""
    return [sys.executable, "-c", "from autotune.cli import main; main()", *args]


def autotune(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cli(*args), cwd=cwd, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
    )


def _plain(url: str) -> str:
    """The URL as a user writes it, without naming the driver."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def _sizes(trials: list[Any] | None) -> list[int] | None:
    return None if trials is None else [int(t.params["micro_batch_size"]) for t in trials]


def _best_feasible(store: TrialStore) -> tuple[int, Any, float]:
    """The point with the best mean over its measurements (all feasible): the number of its
    latest trial, the trial, and the mean."""
    groups: dict[Any, list[Any]] = {}
    for m in store.measurements((TrialState.COMPLETE,)):
        groups.setdefault(m.key, []).append(m)
    means = {
        k: sum(m.value for m in group) / len(group)
        for k, group in groups.items()
        if all(m.feasible and m.value for m in group)
    }
    top = max(means, key=lambda k: means[k])
    latest = max(groups[top], key=lambda m: m.number)
    return latest.number, latest, means[top]


def _close_and_reap(procs: list[subprocess.Popen[str]]) -> None:
    """Close each helper process's standard input (its cue to end), then reap it; one still
    running after a minute is killed."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_trial_store_round_trip_on_postgresql(fresh_postgres_url: str, tmp_path: Path) -> None:
    url = fresh_postgres_url
    store = check_probes_become_trials(url, tmp_path)
    best = store.best()
    assert best is not None

    # A trial asked by one worker is visible to another as RUNNING before it is told.
    running = store.ask(TrainConfig(engine="deepspeed", zero_stage=2), 4)
    other = TrialStore(_fingerprint(), storage=url)
    seen = {m.key: m for m in other.measurements()}
    in_flight = seen[(TrainConfig(engine="deepspeed", zero_stage=2), 4)]
    assert in_flight.state == "RUNNING" and in_flight.outcome is None
    assert other.study.study_name == store.study.study_name
    store.study.tell(running, state=TrialState.FAIL)

    # A second study in the same database; existing() finds both, fingerprints intact.
    TrialStore(_fingerprint(gpus=16), storage=url)
    found = {s.fingerprint.study_name: s for s in TrialStore.existing(url)}
    assert sorted(found) == sorted([_fingerprint().study_name, _fingerprint(gpus=16).study_name])
    reread = found[_fingerprint().study_name]
    assert reread.fingerprint == _fingerprint()
    assert reread.fingerprint.to_dict() == _fingerprint().to_dict()
    assert reread.workload == WORK
    assert [(m.key, m.state, m.outcome, m.value) for m in reread.measurements()] == [
        (m.key, m.state, m.outcome, m.value) for m in store.measurements()
    ]
    reread_best = reread.best()
    assert reread_best is not None
    assert (reread_best.number, reread_best.key) == (best.number, best.key)
    assert reread_best.attrs == best.attrs  # JSON user attributes survive the round trip
    assert found[_fingerprint(gpus=16).study_name].measurements() == []


def test_the_reader_matches_optuna_on_postgresql(fresh_postgres_url: str, tmp_path: Path) -> None:
    check_reader_matches_optuna(fresh_postgres_url, tmp_path)


def test_a_grown_study_reads_as_through_optuna_on_postgresql(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    check_a_grown_study_reads_as_through_optuna(fresh_postgres_url, tmp_path)


def test_running_trials_without_a_heartbeat_fail_as_stale_on_postgresql(
    fresh_postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "HEARTBEAT_S", 1)
    monkeypatch.setattr(store_module, "GRACE_S", 1)
    other = TrialStore(_fingerprint(), storage=fresh_postgres_url)
    other.ask(TrainConfig(engine="fsdp", zero_stage=2), 4)  # alive, but it stops beating
    fresh = TrialStore(_fingerprint(), storage=fresh_postgres_url)
    assert fresh.fail_stale() == []  # within the grace period: still running
    time.sleep(2.5)
    resumed = TrialStore(_fingerprint(), storage=fresh_postgres_url)
    assert resumed.fail_stale() == [0]
    (m,) = resumed.measurements()
    assert (m.state, m.outcome) == ("FAIL", "stale")


def test_running_trials_of_a_dead_tuner_on_this_host_fail_at_once_on_postgresql(
    fresh_postgres_url: str,
) -> None:
    check_dead_tuner_trials_fail_at_once(fresh_postgres_url)


def test_two_workers_never_claim_the_same_point_on_postgresql(fresh_postgres_url: str) -> None:
    check_claims_never_overlap(fresh_postgres_url)


def test_interleaved_claims_never_both_hold_a_point(fresh_postgres_url: str) -> None:
    """Worker A writes its first trial; worker B claims in full; A writes the rest and looks.

    Two workers' claims interleave like this whenever both run at once: whatever the order,
    at most one of them may come away holding the point they share (micro-batch 4).
    """
    a = TrialStore(_fingerprint(), storage=fresh_postgres_url)
    b = TrialStore(_fingerprint(), storage=fresh_postgres_url)
    config = TrainConfig(engine="fsdp", zero_stage=3)
    claimed_by_b: list[list[int] | None] = []
    ask = a.ask

    def ask_then_let_b_claim(cfg: TrainConfig, micro_batch_size: int, **kwargs: Any) -> Any:
        trial = ask(cfg, micro_batch_size, **kwargs)
        if not claimed_by_b:
            claimed_by_b.append(_sizes(b.claim(config, [4, 8])))
        return trial

    a.ask = ask_then_let_b_claim  # type: ignore[method-assign]
    got_a = a.claim(config, [2, 4])
    held_a = _sizes(got_a)
    holders = [held for held in (held_a, claimed_by_b[0]) if held and 4 in held]
    assert len(holders) <= 1, f"both workers hold micro-batch 4: A {held_a}, B {claimed_by_b[0]}"
    running = Counter(m.key for m in a.measurements((TrialState.RUNNING,)))
    assert all(n == 1 for n in running.values()), running


def test_a_missing_database_is_one_clear_line(postgres_url: str) -> None:
    missing = postgres_url.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(ConfigError, match=r"cannot open trial storage.*no_such_database") as err:
        open_storage(missing)
    assert "\n" not in str(err.value)


def test_cli_run_best_and_trials_against_postgresql(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    url = fresh_postgres_url
    trials_dir = tmp_path / "trials"
    run = autotune(*RUN_ARGS, "--storage", url, "--trials-dir", str(trials_dir), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["probes"] > 0
    assert summary["best"] is not None and summary["best"]["simulated"] is True

    # Read back with the URL as users write it (no driver named).
    best = autotune("best", "--storage", _plain(url), "--json", cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    [entry] = json.loads(best.stdout)
    assert entry["study"] == summary["study"]
    assert entry["fingerprint"]["model"] == "llama-7b"
    assert entry["fingerprint"]["gpus"] == 8 and entry["fingerprint"]["device"] == "simulated"
    row = entry["best"]
    assert row["config"] == summary["best"]["config"]
    assert row["micro_batch_size"] == summary["best"]["micro_batch_size"]
    assert row["objective"] == pytest.approx(summary["best"]["objective"])
    assert row["feasible"] is True and row["state"] == "COMPLETE"

    listed = autotune("trials", "--storage", url, "--json", cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    [study] = json.loads(listed.stdout)
    assert study["study"] == summary["study"]
    rows = study["trials"]
    assert len(rows) == entry["trials"] >= summary["probes"]
    assert {r["state"] for r in rows} <= {"COMPLETE", "FAIL"}  # nothing left RUNNING
    assert row["number"] in {r["number"] for r in rows}
    for r in rows:
        assert Path(r["probe_dir"]).is_dir() and trials_dir in Path(r["probe_dir"]).parents
    keys = [
        (json.dumps(r["config"], sort_keys=True), r["micro_batch_size"], r["repeat"]) for r in rows
    ]
    assert len(set(keys)) == len(keys)

    again = autotune(*RUN_ARGS, "--storage", url, "--trials-dir", str(trials_dir), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(again.stdout)
    assert resumed["probes"] == 0  # everything was measured by the first run
    assert resumed["study"] == summary["study"]
    assert resumed["best"]["config"] == summary["best"]["config"]
    assert resumed["best"]["micro_batch_size"] == summary["best"]["micro_batch_size"]
    [store] = TrialStore.existing(url)
    assert len(store.measurements()) == len(rows)  # nothing was added by the second run


RESUMER = """
import json, sys
import optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
sys.path.insert(0, "tests/study")
from test_store import _fingerprint
from autotune.study import TrialStore
print("ready", flush=True)
for url in sys.stdin:
    store = TrialStore(_fingerprint(), storage=url.strip())
    print("open", flush=True)
    sys.stdin.readline()  # all at once
    try:
        print(json.dumps(store.fail_stale()), flush=True)
    except Exception as error:
        print(f"error: {type(error).__name__}: {error}", flush=True)
"""

DIES_CLAIMING = """
import sys
sys.path.insert(0, "tests/study")
from test_store import _fingerprint
from autotune.config import TrainConfig
from autotune.study import TrialStore
for url in sys.argv[1:]:
    store = TrialStore(_fingerprint(), storage=url)
    store.claim(TrainConfig(engine="fsdp", zero_stage=3), [1, 2, 4])
"""


def test_tuners_resuming_together_fail_each_trial_of_a_dead_one_once(
    postgres_server: PostgresServer,
) -> None:
    """A tuner died holding a claim; several start at the same moment and each looks for
    trials left running: every one of them goes on, and each trial is failed by one."""
    urls = [postgres_server.create_database(f"resume_{n}") for n in range(3)]
    subprocess.run(
        [sys.executable, "-c", DIES_CLAIMING, *urls], cwd=ROOT, check=True, timeout=CLI_TIMEOUT_S
    )  # its claims stay RUNNING, and its process is gone
    resumers = [
        subprocess.Popen(
            [sys.executable, "-c", RESUMER],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(4)
    ]
    answers: list[list[str]] = []
    try:
        for resumer in resumers:
            assert resumer.stdout is not None and resumer.stdout.readline().strip() == "ready"
        for url in urls:
            for line in (url, "go"):
                for resumer in resumers:
                    assert resumer.stdin is not None
                    resumer.stdin.write(line + "\n")
                    resumer.stdin.flush()
                if line == url:
                    for resumer in resumers:
                        assert resumer.stdout is not None
                        assert resumer.stdout.readline().strip() == "open"
            answers.append([r.stdout.readline().strip() for r in resumers if r.stdout])
    finally:
        _close_and_reap(resumers)
    for url, answer in zip(urls, answers, strict=True):
        errors = [a for a in answer if not a.startswith("[")]
        assert not errors, errors
        failed = [number for a in answer for number in json.loads(a)]
        assert sorted(failed) == [0, 1, 2], answer  # each trial by exactly one of them
        [store] = TrialStore.existing(url)
        assert [(m.state, m.outcome) for m in store.measurements()] == [("FAIL", "stale")] * 3


HELD_TABLE = "trial_system_attributes"
"""Optuna's table that a probe's record writes (its memory constraint) after the claim and
before the trial is told: a test that holds a lock on it holds every worker inside a claim."""


def _worker(url: str, name: str, tmp_path: Path) -> subprocess.Popen[str]:
    """A tuner worker through the real CLI, with probe folders of its own. Its database
    sessions carry ``name`` (libpq's ``application_name``), so the server says which worker
    a session belongs to."""
    return subprocess.Popen(
        _cli(*RUN_ARGS, "--storage", f"{_plain(url)}?application_name={name}",
             "--trials-dir", str(tmp_path / name)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _hold_until_blocked(
    watch: Any, holder_pid: int, workers: dict[str, subprocess.Popen[str]]
) -> None:
    """Wait until a session of every worker waits for the lock held by ``holder_pid``."""
    deadline = time.monotonic() + CLI_TIMEOUT_S
    blocked: set[str] = set()
    while not set(workers) <= blocked:
        for name, worker in workers.items():
            if worker.poll() is not None:
                _, stderr = worker.communicate()
                pytest.fail(f"worker {name} exited {worker.returncode} while held:\n{stderr}")
        if time.monotonic() > deadline:
            pytest.fail(f"only {sorted(blocked)} of {sorted(workers)} reached the held write")
        time.sleep(0.05)
        rows = watch.execute(
            "SELECT application_name FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (holder_pid,),
        ).fetchall()
        blocked = {name for (name,) in rows}


def _finish(workers: dict[str, subprocess.Popen[str]]) -> dict[str, tuple[int, str, str]]:
    outputs = {}
    for name, worker in workers.items():
        stdout, stderr = worker.communicate(timeout=CLI_TIMEOUT_S)
        outputs[name] = (worker.returncode, stdout, stderr)
    return outputs


def test_four_workers_share_one_study_and_a_killed_one_blocks_nothing(
    fresh_postgres_url: str, tmp_path: Path
) -> None:
    """Four tuners on one study at once, and a fifth killed (SIGKILL) while it holds a claim.

    The fifth starts alone, so it claims the search's first point. A lock the test holds on
    the table that recording a probe writes stops every worker inside its first claim: the
    fifth dies holding RUNNING trials, and the four have each claimed a point before any
    result is in. Once the lock is released, the four finish the search among themselves:
    they fail the dead worker's trials (each by one of them), probe its point, measure no
    point twice, leave nothing RUNNING, and all report the study's best.
    """
    import psycopg

    url = fresh_postgres_url
    # The schema exists before the workers start, as on a shared server in use.
    open_storage(url)
    holder = psycopg.connect(_plain(url))
    watch = psycopg.connect(_plain(url), autocommit=True)
    holder.execute(f"LOCK TABLE {HELD_TABLE} IN EXCLUSIVE MODE")  # reads still pass
    survivors: dict[str, subprocess.Popen[str]] = {}
    victim = _worker(url, "victim", tmp_path)
    try:
        _hold_until_blocked(watch, holder.info.backend_pid, {"victim": victim})
        survivors = {name: _worker(url, name, tmp_path) for name in ("w0", "w1", "w2", "w3")}
        _hold_until_blocked(watch, holder.info.backend_pid, {"victim": victim, **survivors})

        [held] = TrialStore.existing(url)
        claims = held.measurements((TrialState.RUNNING,))
        owners = {name: worker.pid for name, worker in survivors.items()}
        killed = [m for m in claims if m.attrs.get("pid") == victim.pid]
        assert killed, f"the fifth worker holds no claim: {claims}"
        assert {m.attrs.get("pid") for m in claims} == {victim.pid, *owners.values()}
        victim.kill()
        victim.communicate()  # reaped: the dead worker is gone, not a zombie
        holder.rollback()  # the lock goes; the four go on
        outputs = _finish(survivors)
    finally:
        holder.close()
        watch.close()
        for worker in (victim, *survivors.values()):
            if worker.poll() is None:
                worker.kill()
                worker.communicate()
    assert victim.returncode == -signal.SIGKILL
    for name, (code, _, stderr) in outputs.items():
        assert code == 0, f"{name}: {stderr}"
    summaries = {name: json.loads(stdout) for name, (_, stdout, _) in outputs.items()}
    assert {s["study"] for s in summaries.values()} == {held.fingerprint.study_name}
    # Each held a claim when the lock went: all four probed.
    assert all(s["probes"] >= 1 for s in summaries.values()), summaries

    [store] = TrialStore.existing(url)
    trials = store.measurements()
    assert not [m for m in trials if m.state == "RUNNING"], "trials left RUNNING"
    complete = [m for m in trials if m.state == "COMPLETE"]
    counts = Counter((*m.key, m.repeat) for m in complete)
    twice = sorted(
        f"{config.label()} at micro-batch {mbs}, measurement {repeat} (x{n})"
        for (config, mbs, repeat), n in counts.items()
        if n > 1
    )
    assert not twice, f"measured by two workers: {twice}"

    # The dead worker's claims failed as stale, each by one of the four, and its points
    # were probed by them.
    by_number = {m.number: m for m in trials}
    for claim in killed:
        dead = by_number[claim.number]
        assert (dead.state, dead.outcome) == ("FAIL", "stale"), dead
        again = [m for m in complete if (*m.key, m.repeat) == (*claim.key, claim.repeat)]
        assert again and again[0].attrs.get("pid") in owners.values(), f"not probed: {claim}"
    assert sum(s["stale"] for s in summaries.values()) == len(killed)

    # Every probe a worker made is in the study: its folders are the study's trials', and
    # each survivor's probes are as many as the folders of its trials.
    folders = {m.probe_dir for m in trials}
    for name in ("victim", *survivors):
        made = {str(p) for p in (tmp_path / name).glob("*/*")}
        assert made <= folders, f"{name}'s probe folders not in the study: {made - folders}"
    for name, pid in owners.items():
        own = {m.probe_dir for m in trials if m.attrs.get("pid") == pid}
        assert len(own) == summaries[name]["probes"], name

    # All agree on the best: each worker's summary, `autotune best`, and the study's pooled
    # best (a re-measured near-tie ranked by its mean). A worker that stopped while another
    # still re-measured that point saw fewer of its repeats: the same point, its mean and
    # latest folder as of then.
    best = autotune("best", "--storage", url, "--json", cwd=tmp_path)
    assert best.returncode == 0, best.stderr
    [entry] = json.loads(best.stdout)
    number, expected, mean = _best_feasible(store)
    assert entry["best"]["number"] == number
    assert entry["best"]["config"] == expected.config.to_dict()
    assert entry["best"]["micro_batch_size"] == expected.micro_batch_size
    assert entry["best"]["objective"] == pytest.approx(mean)
    for name, summary in summaries.items():
        mine = summary["best"]
        assert (mine["config"], mine["micro_batch_size"]) == (
            entry["best"]["config"],
            entry["best"]["micro_batch_size"],
        ), name
        assert 1 <= mine["repeats"] <= entry["best"]["repeats"], name
        if mine["repeats"] == entry["best"]["repeats"]:
            assert mine["probe_dir"] == entry["best"]["probe_dir"], name
            assert mine["objective"] == pytest.approx(entry["best"]["objective"]), name
        else:  # its folder is one of the point's measurements, before the last
            seen = [m for m in trials if m.key == expected.key and m.state == "COMPLETE"]
            assert mine["probe_dir"] in {m.probe_dir for m in seen}, name
            assert mine["probe_dir"] != entry["best"]["probe_dir"], name


OPENER = """
import sys
from autotune.study import open_storage
print("ready", flush=True)
for url in sys.stdin:
    try:
        open_storage(url.strip())
        print("ok", flush=True)
    except Exception as error:
        print("error:", error, flush=True)
"""


def test_workers_starting_together_on_an_empty_database_all_open_it(
    postgres_server: PostgresServer,
) -> None:
    """Several tuners started at once on a new database: every one of them opens it.

    Each round gives the same fresh database to all of them at the same moment, so their
    first connection (which creates Optuna's tables) races.
    """
    openers = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    failures = []
    try:
        for opener in openers:
            assert opener.stdout is not None and opener.stdout.readline().strip() == "ready"
        for round_ in range(5):
            url = postgres_server.create_database(f"together_{round_}")
            for opener in openers:
                assert opener.stdin is not None
                opener.stdin.write(url + "\n")
                opener.stdin.flush()
            for opener in openers:
                assert opener.stdout is not None
                answer = opener.stdout.readline().strip()
                if answer != "ok":
                    failures.append(f"round {round_}: {answer}")
    finally:
        _close_and_reap(openers)
    assert not failures, "\n".join(failures)
