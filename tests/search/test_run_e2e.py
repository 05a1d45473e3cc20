"""`autotune run` end to end on the CPU: real tuner processes, real probe ranks, no mocks.

Every run here is the real console entry point in its own session, with real probe processes
under an emulated device-memory cap, and its own trial database and probe folders in
``tmp_path``. The cap is never a fixed number: the ``setup`` fixture measures real peaks with
``autotune probe --json`` and derives the cap from them, so that one size runs out of memory
for real while the next smaller one fits. It reads the estimator's predictions (the rows the
tuner plans with for the emulated CPU device, and ``autotune plan --json`` agrees) only to
place the cap where the search's first probe sweeps both sizes: before a configuration is
measured, the search lets a size that may fit within the estimator's prior error
(``PRIOR_ERROR``) into the probe, so the OOM does not depend on the estimator being wrong: an
exact estimator provokes it as well as one that under-predicts. The fixture asserts these
preconditions first.

- A: a real (emulated) OOM is recorded as an infeasible trial, and the search goes on (a later
  trial completes) and ends with a feasible best that ``autotune best`` reads back.
- B: a tuner SIGKILLed mid-probe (its ranks die with it) is resumed: the
  dead tuner's RUNNING trials are failed at once, their points retried once, nothing COMPLETE
  is probed again, and a second rerun probes nothing.
- C: Ctrl-C (SIGINT to the tuner's process group, as a terminal sends it) or SIGTERM stops the
  running probe, records its trials as interrupted, prints the best so far and exits 130 or
  143; a rerun retries them once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from autotune.api import prepare
from autotune.cli import app
from autotune.config import TrainConfig, ac_to_text
from autotune.estimator.plan import PlanRow
from autotune.hardware import cpu_device_spec
from autotune.probe import faults
from autotune.search.ladder import PRIOR_ERROR

pytestmark = pytest.mark.slow

UNTIL_S = 240.0
"""Longest wait for a tuner to reach a state or to finish (a failure, not a timing claim)."""


@dataclass(frozen=True)
class Workload:
    """One rank on the CPU: the single engine, probes of a few seconds each."""

    model: str
    seq_len: int = 64
    global_batch: int = 16

    @property
    def sizes(self) -> list[int]:
        """Micro-batch sizes that reach the global batch exactly on one rank."""
        return [m for m in range(1, self.global_batch + 1) if self.global_batch % m == 0]

    def args(self) -> list[str]:
        return ["--model", self.model, "--seq-len", str(self.seq_len), "--gpus", "1"]

    @property
    def space(self) -> list[str]:
        """The ladder's two rungs these tests reason about, ac:off and ac:every: without the
        chunked loss, op-level checkpointing, activation offload and the 8-bit optimizer (``plan``
        and ``run`` options)."""
        return ["--loss", "full", "--no-ac-ops", "--no-act-offload", "--optimizer", "adamw"]


@dataclass(frozen=True)
class Setup:
    """A derived cap and what the search is expected to do under it."""

    workload: Workload
    cap: int
    config: dict[str, Any]
    """The configuration the search probes first (TrainConfig.to_dict())."""
    oom_size: int
    """The size its first probe sweeps that really runs out of memory under ``cap`` (the next
    smaller size, swept too, fits)."""
    second: str
    """The label of the configuration the search probes second."""
    why: str


# --------------------------------------------------------------------------- CLI helpers


def cli(*args: str, expect: int | None = 0) -> str:
    """Run an ``autotune`` command in this process (plan, probe, trials, best); its stdout."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    if expect is not None:
        assert result.exit_code == expect, (args, result.exit_code, result.output)
    return result.stdout


def plan_rows(workload: Workload, cap: int, folder: Path) -> list[dict[str, Any]]:
    """``autotune plan --json`` for the emulated CPU device the tuner plans with at ``cap``.

    The tuner plans for ``cpu_device_spec(cap)`` with no reserve, and drops offload rows on
    the CPU; the same here, so the rows are the ones the search ranks.
    """
    folder.mkdir(parents=True, exist_ok=True)
    gpu_file = folder / f"cpu-{cap}.toml"
    gpu_file.write_text(cpu_device_spec(cap).to_toml())
    data = json.loads(
        cli(
            "plan",
            *workload.args(),
            *workload.space,
            "--global-batch",
            str(workload.global_batch),
            "--gpu",
            str(gpu_file),
            "--reserve",
            "0",
            "--top",
            "0",
            "--json",
        )
    )
    assert data["predicted"] is True
    return [row for row in data["rows"] if row["config"]["offload"] == "none"]


def tuner_rows(workload: Workload, cap: int, folder: Path) -> list[PlanRow]:
    """The estimator's rows the tuner ranks under ``cap``, from its own planning (no probe):
    each has the predicted peak (``peak_at``) and tokens/s (``speeds``) at every size."""
    tuning = prepare(
        workload.model,
        seq_len=workload.seq_len,
        global_batch=workload.global_batch,
        gpus=1,
        device="cpu",
        device_memory=cap,
        storage=f"sqlite:///{folder}/estimates.db",
        trials_dir=folder / "trials",
        losses="full",
        op_checkpointing=False,
        optimizers="adamw",
    )
    return tuning.rows


def estimate_of(rows: list[PlanRow], config: dict[str, Any]) -> PlanRow:
    return next(row for row in rows if row.config.to_dict() == config)


def row_of(rows: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    return next(row for row in rows if row["config"] == config)


def measure_peaks(
    workload: Workload, config: dict[str, Any], sizes: list[int], folder: Path
) -> dict[int, int]:
    """Real peak bytes per size: ``autotune probe --json`` without a cap, one rank.

    One warm-up and one timed step: the peak is reached by the second step (the optimizer's
    states exist from the first optimizer step on), so the tuner's longer probes peak alike.
    """
    data = json.loads(
        cli(
            "probe",
            *workload.args(),
            "--device",
            "cpu",
            "--engine",
            config["engine"],
            "--zero-stage",
            str(config["zero_stage"]),
            "--precision",
            config["precision"],
            "--ac",
            ac_to_text(config["ac_every"], config["ac_ops"]),
            "--attention",
            config["attention"],
            "--loss",
            config["loss"],
            "--optimizer",
            config["optimizer"],
            "--lora-rank",
            str(config["lora_rank"]),
            "--micro-batch",
            ",".join(map(str, sizes)),
            "--warmup-steps",
            "1",
            "--steps",
            "1",
            "--trials-dir",
            str(folder),
            "--json",
        )
    )
    assert data["spec"]["config"] == config
    peaks = {}
    for size in data["sizes"]:
        assert size["outcome"] == "ok", size
        # The ladder calibrates with reserved bytes where present, as here.
        peaks[size["micro_batch_size"]] = (
            size["peak_reserved_bytes"] or size["peak_allocated_bytes"]
        )
    assert sorted(peaks) == sorted(sizes)
    return peaks


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


# --------------------------------------------------------------------------- processes


def tuner_command(setup: Setup, root: Path, *extra: str) -> list[str]:
    workload = setup.workload
    return [
        sys.executable,
        "-c",
        "from autotune.cli import main; main()",
        "run",
        *workload.args(),
        *workload.space,
        "--global-batch",
        str(workload.global_batch),
        "--device",
        "cpu",
        "--device-memory",
        str(setup.cap),
        "--budget",
        "2m",
        "--storage",
        f"sqlite:///{root}/t.db",
        "--trials-dir",
        str(root / "trials"),
        "--json",
        *extra,
    ]


def start_tuner(setup: Setup, root: Path, hold_second: bool = False) -> subprocess.Popen[str]:
    """The tuner in its own session (so signals reach it and not pytest). ``hold_second``:
    the second configuration's probe hangs after its build (a test fault, with the tuner
    armed as the suite is), so a signal always finds it running, however fast its steps."""
    command = tuner_command(setup, root)
    env = dict(os.environ)
    env.pop(faults.FAULT_ENV, None)
    if hold_second:
        command[1:3] = ["-c", f"from autotune.probe import faults; faults.arm(); {command[2]}"]
        env[faults.FAULT_ENV] = f"hang@0:{setup.second}"
    return subprocess.Popen(
        command,
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_tuner(setup: Setup, root: Path) -> tuple[int, dict[str, Any], str]:
    """Run the tuner to the end; exit code, --json summary, stderr."""
    done = subprocess.run(
        tuner_command(setup, root),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=UNTIL_S,
        check=False,
        start_new_session=True,
    )
    assert done.stdout.strip(), f"no summary (exit {done.returncode}):\n{done.stderr}"
    return done.returncode, json.loads(done.stdout), done.stderr


def processes_of(root: Path) -> list[psutil.Process]:
    """Live processes of this test: the tuner (its storage URL) and fresh probe ranks (their
    probe folder) name ``root`` on their command line; the tuner, its warm workers and ranks
    forked from them run in ``root``; anything in their process groups too."""
    needle = str(root).rstrip("/")
    own_group = os.getpgid(0)
    found: dict[int, psutil.Process] = {}
    groups: set[int] = set()
    procs = list(psutil.process_iter(["cmdline", "status", "cwd"]))
    for proc in procs:
        try:
            if proc.pid == os.getpid() or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            parts = [*(proc.info["cmdline"] or []), proc.info["cwd"] or ""]
            if any(part == needle or f"{needle}/" in part for part in parts):
                found[proc.pid] = proc
                groups.add(os.getpgid(proc.pid))
        except (psutil.Error, ProcessLookupError):
            continue
    groups.discard(own_group)
    for proc in procs:
        try:
            if (
                proc.pid not in found
                and proc.info["status"] != psutil.STATUS_ZOMBIE
                and os.getpgid(proc.pid) in groups
            ):
                found[proc.pid] = proc
        except (psutil.Error, ProcessLookupError):
            continue
    return list(found.values())


def wait_gone(root: Path, timeout_s: float = 15.0) -> list[psutil.Process]:
    """Wait until no process of ``root`` is alive; what is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_of(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The test's folder; afterwards no process of it may be left (those found are killed
    by pid, and the test fails)."""
    yield tmp_path
    left = wait_gone(tmp_path, timeout_s=5.0)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not left, f"processes of the test outlived it: {left}"


def trial_states(root: Path) -> list[str]:
    """Every trial's state while a tuner runs, read from the database file read-only.

    Plain SQLite in read-only mode: reading must neither create Optuna's tables nor race the
    tuner that is creating them (the file may exist before its schema does)."""
    try:
        with contextlib.closing(
            sqlite3.connect(f"file:{root / 't.db'}?mode=ro", uri=True, timeout=5.0)
        ) as db:
            return [state for (state,) in db.execute("SELECT state FROM trials")]
    except sqlite3.OperationalError:
        return []  # no file yet, no tables yet, or locked by the tuner's write: look again


def running_probe_dir(root: Path) -> Path | None:
    """A probe folder without a result whose rank 0 runs (its report exists) and was started
    0.3 s or more ago (the launcher wrote the folder's config just before), so the launcher
    is waiting on it. A probe forked from the warm workers takes about a second in all."""
    for folder in (root / "trials").glob("*/*"):
        if (folder / "result.json").exists() or not (folder / "rank0.json").exists():
            continue
        with contextlib.suppress(OSError):
            if time.time() - (folder / "config.json").stat().st_mtime >= 0.3:
                return folder
    return None


def wait_for_second_probe(tuner: subprocess.Popen[str], root: Path, setup: Setup) -> Path:
    """Wait until one trial is COMPLETE, one RUNNING, and the running probe's ranks started."""
    deadline = time.monotonic() + UNTIL_S
    while time.monotonic() < deadline:
        if tuner.poll() is not None:
            out, err = tuner.communicate()
            pytest.fail(
                f"the tuner ended (exit {tuner.returncode}) before a second probe; the set-up "
                f"expects the search to probe both configurations ({setup.why}):\n{out}\n{err}"
            )
        if (root / "t.db").exists():
            states = Counter(trial_states(root))
            # The folder is looked for after the trials: once the first probe is COMPLETE its
            # folder holds its result, so the folder still running is the second probe's.
            if states["COMPLETE"] >= 1 and states["RUNNING"] >= 1:
                folder = running_probe_dir(root)
                if folder is not None:
                    return folder
        time.sleep(0.05)
    tuner.kill()
    pytest.fail("the tuner never had a COMPLETE and a RUNNING trial at once")


# --------------------------------------------------------------------------- the study


def trials_of(root: Path) -> list[dict[str, Any]]:
    """``autotune trials --json``: the one study's rows."""
    (study,) = json.loads(cli("trials", "--storage", f"sqlite:///{root}/t.db", "--json"))
    return study["trials"]


def key(row: dict[str, Any]) -> tuple[str, int]:
    """A trial's point: configuration params + micro-batch size."""
    return json.dumps(row["config"], sort_keys=True), row["micro_batch_size"]


def measurement_key(row: dict[str, Any]) -> tuple[str, int, int]:
    """A trial's point and which measurement of it (0, or a deliberate re-measurement)."""
    return (*key(row), row["repeat"])


def config_key(config: dict[str, Any], mbs: int) -> tuple[str, int]:
    return json.dumps(config, sort_keys=True), mbs


def assert_consistent(rows: list[dict[str, Any]], cap: int) -> None:
    """No RUNNING trial; every measurement of a point COMPLETE at most once (a point is measured
    again only as a numbered re-measurement); feasible means fits."""
    running = [r for r in rows if r["state"] == "RUNNING"]
    assert not running, f"trials left RUNNING: {running}"
    complete = Counter(measurement_key(r) for r in rows if r["state"] == "COMPLETE")
    repeated = {k: n for k, n in complete.items() if n > 1}
    assert not repeated, f"points measured COMPLETE more than once: {repeated}"
    for row in rows:
        if row["feasible"]:
            assert row["outcome"] == "ok" and 0 < row["peak_bytes"] <= cap, row


def best_of(rows: list[dict[str, Any]]) -> tuple[tuple[str, int], float, int]:
    """The feasible point with the best mean objective over its COMPLETE measurements (every
    one feasible): its key, that mean, and how many measurements it has."""
    points: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row["state"] == "COMPLETE":
            points.setdefault(key(row), []).append(row)
    means = {
        k: sum(r["objective"] for r in group) / len(group)
        for k, group in points.items()
        if all(r["feasible"] for r in group)
    }
    top = max(means, key=lambda k: means[k])
    return top, means[top], len(points[top])


def assert_is_best(best: dict[str, Any] | None, rows: list[dict[str, Any]], cap: int) -> None:
    """``best`` (a summary's or ``autotune best``'s) is the best point of ``rows``, measured
    feasible, with its objective pooled over its repeats, and it fits the cap."""
    assert best is not None, rows
    assert best["outcome"] == "ok"
    peak = best.get("peak_allocated_bytes", best.get("peak_bytes"))
    assert peak is not None and 0 < peak <= cap, best
    top, mean, repeats = best_of(rows)
    assert key(best) == top, (best, rows)
    assert best["objective"] == pytest.approx(mean)
    assert best["repeats"] == repeats


def assert_feasible_best(summary: dict[str, Any], rows: list[dict[str, Any]], cap: int) -> None:
    """The summary's best is the best point of the study's rows."""
    assert_is_best(summary["best"], rows, cap)


def resume_checks(
    setup: Setup,
    root: Path,
    before: list[dict[str, Any]],
    cut: list[dict[str, Any]],
    *,
    second_rerun: bool,
) -> dict[str, Any]:
    """Rerun to the end after an interruption; the checks B and C share. ``cut`` are the
    trials the interruption left (RUNNING or interrupted). Returns the rerun's summary."""
    code, summary, stderr = run_tuner(setup, root)
    assert code == 0, stderr
    assert summary["stop_reason"].startswith("search done"), summary
    after = trials_of(root)
    assert_consistent(after, setup.cap)
    assert_feasible_best(summary, after, setup.cap)
    known = {r["number"] for r in before}
    new = [r for r in after if r["number"] not in known]
    measured_before = {measurement_key(r) for r in before if r["state"] == "COMPLETE"}
    again = [r for r in new if measurement_key(r) in measured_before]
    assert not again, f"the rerun probed points already measured: {again}"
    cut_keys = {measurement_key(r) for r in cut}
    retries = Counter(measurement_key(r) for r in new if measurement_key(r) in cut_keys)
    # The interrupted point is what the search was measuring: it is retried, exactly once.
    assert retries == dict.fromkeys(cut_keys, 1), (retries, cut_keys)
    assert summary["probes"] >= 1
    if not second_rerun:
        return summary
    # A second rerun finds everything it needs in the study.
    code, second, stderr = run_tuner(setup, root)
    assert code == 0, stderr
    assert second["probes"] == 0, second
    assert len(trials_of(root)) == len(after)
    assert (second["best"]["config"], second["best"]["micro_batch_size"]) == (
        summary["best"]["config"],
        summary["best"]["micro_batch_size"],
    )
    return summary


# --------------------------------------------------------------------------- the set-up


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """A cap from real peaks: the search's first probe runs out of memory at one size and fits
    at the next smaller one, whether the estimator is exact or under-predicts.

    The GPT-2-style tiny model on one rank has two configurations, ``ac:every`` and ``ac:off``
    (one family). A configuration's first probe aims at the largest size predicted to fit
    (predicted peak <= cap) and sweeps that size, the size below it, and every size above it
    that may still fit (predicted peak <= cap / (1 - ``PRIOR_ERROR``)). The real peaks of
    ``ac:every`` at ``target`` and ``above`` (2 and 4 of 1, 2, 4, 8, 16) are measured, and the
    cap is put half-way inside the band where

    - the real peaks say ``target`` fits and ``above`` runs out of memory;
    - the estimator aims at ``target`` or ``above``: ``target`` is predicted to fit, the next
      size ``after`` (8) is not;
    - ``above`` may fit: its predicted peak is within cap / (1 - ``PRIOR_ERROR``).

    The first probe of ``ac:every`` then sweeps ``target`` and ``above``, keeps ``target`` and
    runs out of memory at ``above``, for real. No gap between estimate and truth is needed: an
    exact estimator aims at ``target`` and lets ``above`` in as a size that may fit; one that
    under-predicts may aim at ``above`` itself, with ``target`` as the size below it.

    The search probes both configurations, ``ac:every`` first (asserted on the tuner's own
    predictions, and `autotune plan` agrees):

    - first: an unmeasured configuration ranks by its predicted speed at the size it aims at;
      ``ac:every`` needs less memory per sample, aims at a larger size than ``ac:off`` and is
      predicted faster there;
    - second: the best is then ``ac:every`` at ``target``; ``ac:off`` is predicted faster than
      that at the largest size that may fit it, and ``ac:every``'s measured/predicted speed
      calibrates both (one family), so ``ac:off``'s bound stays above the best and the search
      probes it, after the OOM.
    """
    folder = tmp_path_factory.mktemp("setup")
    workload = Workload(model="tiny-gpt2")
    sizes = workload.sizes
    target, above, after = sizes[1:4]
    # Every field, as the tuner's plan rows and the probe's result write them.
    config = TrainConfig(engine="single", precision="bf16-mixed", ac_every=1).to_dict()
    peaks = measure_peaks(workload, config, [target, above], folder / "probes")
    # The estimator's peak and speed at each size do not depend on the cap.
    estimates = tuner_rows(workload, peaks[target], folder)
    line = estimate_of(estimates, config)
    (rival,) = [row for row in estimates if row is not line]
    predicted = {m: line.peak_at(m) for m in sizes}
    measured = (
        f"{line.config.label()}: the probe measured {mib(peaks[target])} at micro-batch "
        f"{target} and {mib(peaks[above])} at {above}; the estimator predicts "
        f"{mib(predicted[target])}, {mib(predicted[above])} and {mib(predicted[after])} at "
        f"{target}, {above} and {after}"
    )
    # At least: `target` fits for real and on paper, and `above` may fit on paper.
    low = max(peaks[target], predicted[target], (1 - PRIOR_ERROR) * predicted[above])
    # Less than: `above` runs out of memory for real, and `after` is not predicted to fit.
    high = min(peaks[above], predicted[after])
    assert low < high, (
        f"precondition: no cap makes the first probe sweep micro-batch {target} and {above} "
        f"(predicted to fit at {target}, not at {after}, and within the prior error "
        f"{PRIOR_ERROR:.0%} at {above}) while the real peaks make {target} fit and {above} run "
        f"out of memory: {measured}"
    )
    cap = int((low + high) / 2)
    edge = cap / (1 - PRIOR_ERROR)

    def aim(row: PlanRow) -> int | None:
        """The size a first probe aims at: the largest predicted to fit."""
        return max((m for m in sizes if row.peak_at(m) <= cap), default=None)

    first, rival_first = aim(line), aim(rival)
    why = (
        f"under the {mib(cap)} cap (sizes predicted up to {mib(edge)} may fit) "
        f"{line.config.label()} aims at micro-batch {first} and {rival.config.label()} at "
        f"{rival_first}; {measured}"
    )
    assert first in (target, above), f"precondition: aim at {target} or {above}; {why}"
    assert rival_first is not None, f"precondition: both configurations fit; {why}"
    assert predicted[above] <= edge, f"precondition: {above} may fit, so it is swept; {why}"
    assert peaks[target] <= cap < peaks[above], why
    rival_edge = max(m for m in sizes if rival.peak_at(m) <= edge)
    why = (
        f"{why}; predicted tokens/s: {line.config.label()} {line.speeds[first]:.0f} at "
        f"{first} and {line.speeds[target]:.0f} at {target}, {rival.config.label()} "
        f"{rival.speeds[rival_first]:.0f} at {rival_first} (aimed at) and "
        f"{rival.speeds[rival_edge]:.0f} at {rival_edge} (the largest that may fit)"
    )
    assert line.speeds[first] > rival.speeds[rival_first], (
        f"precondition: the search should probe {line.config.label()} first; {why}"
    )
    assert rival.speeds[rival_edge] > line.speeds[target], (
        f"precondition: the search should probe {rival.config.label()} second; {why}"
    )
    # `autotune plan` under the cap agrees: this configuration first, at the size aimed at.
    rows = plan_rows(workload, cap, folder)
    row = row_of(rows, config)
    assert row["capacity_bytes"] == cap and row["fits"], why
    assert rows[0]["config"] == config, (rows[0]["label"], why)
    assert row["micro_batch_size"] == first, (row["micro_batch_size"], why)
    assert row["memory"]["peak_bytes"] == predicted[first], why
    return Setup(
        workload=workload,
        cap=cap,
        config=config,
        oom_size=above,
        second=rival.config.label(),
        why=why,
    )


# --------------------------------------------------------------------------- the tests


def test_a_real_oom_is_recorded_and_the_search_ends_feasible(root: Path, setup: Setup) -> None:
    """A: a size the first probe sweeps runs out of (emulated) memory for real; the OOM is an
    infeasible trial; the search goes on (a trial after it completes) and ends with a feasible
    best that `autotune best` reads back."""
    code, summary, stderr = run_tuner(setup, root)
    assert code == 0, stderr
    assert summary["stop_reason"].startswith("search done"), summary
    assert summary["probes"] >= 2, summary  # it went on after the probe that ran out
    rows = trials_of(root)
    assert_consistent(rows, setup.cap)
    assert_feasible_best(summary, rows, setup.cap)

    ooms = [r for r in rows if r["outcome"] == "oom"]
    assert ooms, f"no trial ran out of memory ({setup.why}): {rows}"
    (oom,) = [r for r in ooms if key(r) == config_key(setup.config, setup.oom_size)]
    assert oom["state"] == "COMPLETE" and not oom["feasible"] and oom["objective"] == 0
    # Really out of memory: the probe's own report names the emulated device's OOM error.
    result = json.loads((Path(oom["probe_dir"]) / "result.json").read_text())
    (size,) = [s for s in result["sizes"] if s["micro_batch_size"] == setup.oom_size]
    assert size["outcome"] == "oom" and size["stage"] in ("forward", "backward"), size
    assert "OutOfMemoryError" in size["message"] and "emulated" in size["message"], size
    assert result["emulated_device_memory_bytes"] == setup.cap
    # Its ranks were forked from the run's warm workers, which a set-up step started once.
    assert result["spawn"] == "warm" and result["startup_s"] >= result["import_s"], result
    assert (
        "fork of autotune's warm worker process" in (Path(oom["probe_dir"]) / "cmd.txt").read_text()
    )
    steps = [(step["label"], step["ok"]) for step in summary["setup"]]
    assert steps == [("starting warm probe workers", True)], summary["setup"]
    # The same configuration at a smaller size fits, measured.
    assert any(
        r["config"] == setup.config and r["feasible"] and r["micro_batch_size"] < setup.oom_size
        for r in rows
    ), rows
    # The search went on after the OOM: a trial numbered after it completed.
    assert any(r["number"] > oom["number"] and r["state"] == "COMPLETE" for r in rows), rows

    (study,) = json.loads(cli("best", "--storage", f"sqlite:///{root}/t.db", "--json"))
    assert study["study"] == summary["study"]
    assert study["trials"] == len(rows)
    # The same point as the summary's, pooled over its repeats alike.
    assert_is_best(study["best"], rows, setup.cap)
    assert key(study["best"]) == key(summary["best"])


def test_b_a_killed_tuner_resumes_without_repeating_a_probe(root: Path, setup: Setup) -> None:
    """B: SIGKILL the tuner while its second probe runs (its ranks die with it), rerun."""
    tuner = start_tuner(setup, root, hold_second=True)
    probe_dir = wait_for_second_probe(tuner, root, setup)
    os.killpg(tuner.pid, signal.SIGKILL)  # the tuner's own session: only the tuner
    tuner.wait()  # reaped: its pid is gone, as after a crash
    tuner.communicate()
    assert tuner.returncode == -signal.SIGKILL

    # The ranks run in their own process group, yet die with their tuner (PR_SET_PDEATHSIG):
    # nothing is left holding (device) memory while the rerun probes again.
    left = wait_gone(root)
    assert not left, f"probe ranks in {probe_dir} outlived their SIGKILLed tuner: {left}"

    before = trials_of(root)
    killed = [r for r in before if r["state"] == "RUNNING"]
    assert killed, f"no trial was RUNNING when the tuner died: {before}"
    assert any(r["state"] == "COMPLETE" for r in before)

    summary = resume_checks(setup, root, before, killed, second_rerun=True)
    assert summary["stale"] == len(killed), summary  # the rerun says what it failed
    numbers = {r["number"] for r in killed}
    for row in trials_of(root):
        if row["number"] in numbers:
            # Failed by the rerun because their tuner's process is gone: the rerun started
            # seconds after the kill, well inside the heartbeat's grace period (a trial still
            # RUNNING would have failed assert_consistent above).
            assert row["state"] == "FAIL" and row["outcome"] == "stale", row


@pytest.mark.parametrize(
    ("signum", "name", "code"),
    [(signal.SIGINT, "Ctrl-C", 130), (signal.SIGTERM, "SIGTERM", 143)],
    ids=["sigint", "sigterm"],
)
def test_c_ctrl_c_stops_the_probe_records_it_and_a_rerun_retries_it(
    root: Path, setup: Setup, signum: int, name: str, code: int
) -> None:
    """C: Ctrl-C (SIGINT to the tuner's process group, as a terminal sends it) or SIGTERM (to
    the tuner, as a scheduler's time limit does) during its second probe, then a rerun.

    An interrupted `autotune run` exits 128 + the signal's number (130, 143), after printing
    its summary with the best found so far (here the first probe's feasible size).
    """
    tuner = start_tuner(setup, root, hold_second=True)
    probe_dir = wait_for_second_probe(tuner, root, setup)
    if signum == signal.SIGINT:
        os.killpg(tuner.pid, signum)  # a terminal's Ctrl-C: the foreground group
    else:
        os.kill(tuner.pid, signum)
    out, err = tuner.communicate(timeout=60)
    assert tuner.returncode == code, (tuner.returncode, out, err)
    summary = json.loads(out)
    assert summary["stop_reason"].startswith(f"interrupted ({name})"), summary
    assert summary["interrupted"] == name, summary
    assert summary["probes"] == 2, summary  # the first probe, and the one it stopped
    # The launcher ended the probe's process group before the tuner exited.
    left = wait_gone(root, timeout_s=2.0)
    assert not left, f"probe processes outlived the interrupted tuner: {left}"
    assert not (probe_dir / "result.json").exists()

    before = trials_of(root)
    assert_consistent(before, setup.cap)  # nothing left RUNNING
    assert_feasible_best(summary, before, setup.cap)
    interrupted = [r for r in before if r["outcome"] == "interrupted"]
    assert interrupted, before
    for row in interrupted:
        assert row["state"] == "FAIL" and Path(row["probe_dir"]) == probe_dir, row
    assert {r["state"] for r in before} == {"COMPLETE", "FAIL"}

    resume_checks(setup, root, before, interrupted, second_rerun=False)
