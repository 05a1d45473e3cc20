"""Faults around a probe, made for real: a folder that cannot be written or is deleted while
the ranks run, rank reports that are garbled, empty or missing, and ranks that flood their
output. Each test checks the verdict is honest, nothing raises in the tuner, and (through the
``run_probe`` fixture) that no process outlives the probe.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RunProbe, probe_failure_text, read_json

import autotune
from autotune.config import Engine, TrainConfig
from autotune.probe.faults import FAULT_ENV, fault_for
from autotune.probe.launcher import read_report
from autotune.probe.outcome import Outcome, Stage
from autotune.probe.output import HEAD_BYTES, TAIL_BYTES, CappedLog
from autotune.probe.worker import FLOOD_BYTES
from tests.test_cli import autotune as run_autotune

DDP = TrainConfig(engine=Engine.DDP)
ROOT = os.geteuid() == 0


def _mount_tmpfs(target: Path, options: str) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], check=True)


@pytest.fixture
def unwritable(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Path, str]]:
    """The probe's folder on a read-only file system, or on a full one: (folder, errno text)."""
    folder = tmp_path / "probe"
    folder.mkdir()
    kind = request.param
    if kind == "read-only" and not ROOT:
        folder.chmod(0o555)  # what makes it read-only to a user who is not root
        yield folder, "Permission denied"
        folder.chmod(0o755)
        return
    if not ROOT:
        pytest.skip("a full file system needs a tmpfs mount (root)")
    if kind == "read-only":
        _mount_tmpfs(folder, "ro,size=1m")
        expected = "Read-only file system"
    else:
        _mount_tmpfs(folder, "size=64k")
        with (folder / "filler").open("wb") as filler, pytest.raises(OSError):
            filler.write(b"x" * (1 << 20))  # fills it
            filler.flush()
        expected = "No space left on device"
    try:
        yield folder, expected
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.mark.parametrize("unwritable", ["read-only", "full"], indirect=True)
def test_unwritable_folder_is_an_error_and_starts_no_rank(
    run_probe: RunProbe, unwritable: tuple[Path, str]
) -> None:
    """A folder the probe cannot write: an error at start-up naming the folder and why, no
    rank started, nothing raised, nothing written."""
    folder, why = unwritable
    before = sorted(p.name for p in folder.iterdir())
    result = run_probe(DDP, num_processes=2, name=folder.name)
    assert result.outcome is Outcome.ERROR
    assert result.stage is Stage.STARTUP
    assert str(folder) in result.message and why in result.message, result.message
    assert result.exits == [] and result.sizes == []
    assert sorted(p.name for p in folder.iterdir()) == before


def test_folder_deleted_while_ranks_run(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both ranks hang after the build; the folder is deleted under them: the launcher stops
    them at once (not at the timeout) and the probe is an error that says so."""
    folder = tmp_path / "doomed"
    monkeypatch.setenv(FAULT_ENV, "hang")

    def delete_when_built() -> None:
        while True:
            reports = [folder / f"rank{r}.json" for r in (0, 1)]
            try:
                if all("build_s" in read_json(r) for r in reports):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        shutil.rmtree(folder)

    deleter = threading.Thread(target=delete_when_built, daemon=True)
    deleter.start()
    result = run_probe(DDP, num_processes=2, name=folder.name, timeout_s=120.0)
    deleter.join(timeout=5)
    assert result.outcome is Outcome.ERROR, probe_failure_text(result)
    assert str(folder) in result.message and "deleted" in result.message
    assert all(e["killed_by_launcher"] for e in result.exits)
    assert not folder.exists()  # not made again to hold a result


@pytest.mark.parametrize(
    ("fault", "problem"),
    [
        ("garble@1", "rank1.json is not valid JSON"),
        ("empty@1", "rank1.json is empty"),
        ("noreport@1", "rank1.json is missing"),
    ],
)
def test_bad_report_of_a_clean_rank_is_an_error(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, fault: str, problem: str
) -> None:
    """Rank 1 trains, then its report is torn, emptied or deleted, and it exits 0: the probe is
    an error naming rank 1 and its file, and no size is ok from rank 0's report alone."""
    monkeypatch.setenv(FAULT_ENV, fault)
    result = run_probe(DDP, num_processes=2)
    assert [e["returncode"] for e in result.exits] == [0, 0]
    assert result.outcome is Outcome.ERROR, probe_failure_text(result)
    assert result.failed_rank == 1
    assert "rank 1" in result.message and problem in result.message, result.message
    assert "Traceback" not in result.message
    assert read_json(result.probe_dir / "rank0.json")["status"] == "ok"
    [size] = result.sizes
    assert size.outcome is Outcome.ERROR and size.tokens_per_second is not None
    assert read_json(result.probe_dir / "result.json")["outcome"] == "error"


@pytest.mark.parametrize(
    ("report", "problem"),
    [
        ([1, 2], "holds list"),
        ({"rank": 0, "status": "ok"}, "says rank 0"),
        ({"rank": 1, "status": "fine"}, "status is 'fine'"),
        ({"rank": 1, "status": "error", "stage": "lunch"}, "stage is 'lunch'"),
        ({"rank": 1, "status": "ok", "sizes": {"2": {}}}, "sizes are not a list"),
        ({"rank": 1, "status": "ok", "sizes": [{"outcome": "ok"}]}, "micro_batch_size None"),
        (
            {"rank": 1, "status": "ok", "sizes": [{"micro_batch_size": 2, "outcome": "fast"}]},
            "size 2 has outcome 'fast'",
        ),
        (
            {
                "rank": 1,
                "status": "ok",
                "sizes": [{"micro_batch_size": 2, "outcome": "ok", "peak_reserved_bytes": "1G"}],
            },
            "peak_reserved_bytes that is not a number",
        ),
        (
            {
                "rank": 1,
                "status": "ok",
                "sizes": [{"micro_batch_size": 2, "outcome": "ok", "losses": "low"}],
            },
            "losses that are not a list of numbers",
        ),
    ],
)
def test_a_report_not_in_the_workers_format_is_rejected(
    tmp_path: Path, report: object, problem: str
) -> None:
    """Valid JSON that is not a rank report is rejected with what is wrong, never read (a
    wrong type would otherwise raise while the sizes are merged)."""
    path = tmp_path / "rank1.json"
    path.write_text(json.dumps(report))
    data, why = read_report(path, 1)
    assert data is None
    assert why.startswith("rank1.json is not a rank report: ") and problem in why, why


def test_capped_log_keeps_head_and_tail(tmp_path: Path) -> None:
    """Written in uneven chunks, a capped log holds exactly the first and last bytes with the
    line between them; output within the cap is kept whole, with no such line."""
    stream = bytes(range(256)) * 40  # 10,240 bytes
    log = CappedLog(tmp_path / "big.log", head=1000, tail=3000)
    for start in range(0, len(stream), 777):
        log.write(stream[start : start + 777])
    log.close()
    text = (tmp_path / "big.log").read_bytes()
    marker = b"\n[autotune: 6240 bytes of output dropped here; big.log keeps the first 1000 "
    assert text.startswith(stream[:1000] + marker)
    assert text.endswith(b" of a probe's output]\n" + stream[-3000:])
    small = CappedLog(tmp_path / "small.log", head=1000, tail=3000)
    small.write(stream[:2500])
    small.write(stream[2500:4000])
    small.close()
    assert (tmp_path / "small.log").read_bytes() == stream[:4000]


def test_flooding_rank_is_capped_and_still_ok(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 writes 100 MiB to stdout and to stderr as fast as it can, then trains: the probe
    is ok, each log holds its head, the line that says what was dropped and its tail (the
    training's last line included), and the tuner's Python memory peaks far below the flood."""
    monkeypatch.setenv(FAULT_ENV, "flood@0")
    tracemalloc.start()
    try:
        result = run_probe()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    assert [s.outcome for s in result.sizes] == [Outcome.OK]
    assert peak < 16 << 20, f"the tuner traced {peak} bytes at its peak"
    for name in ("stdout.log", "stderr.log"):
        log = result.probe_dir / name
        size = log.stat().st_size
        assert HEAD_BYTES + TAIL_BYTES < size < HEAD_BYTES + TAIL_BYTES + 512, (name, size)
        data = log.read_bytes()
        assert data.startswith(b"flood begins\n")
        found = re.search(rb"\n\[autotune: ([0-9.]+) MiB of output dropped here; ", data)
        assert found, f"{name} does not say what it dropped"
        assert float(found[1]) * (1 << 20) >= FLOOD_BYTES - HEAD_BYTES - TAIL_BYTES
        assert b"flood ends\n" in data[-TAIL_BYTES:]
    assert b"micro-batch 2: " in (result.probe_dir / "stdout.log").read_bytes()[-200:]
    assert not list(result.probe_dir.glob(".*.pipe"))


def test_run_records_a_garbled_probe_and_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole CPU run where every FSDP probe's rank 1 tears its report: the run finishes,
    records the FSDP trials as errors with the reason, and finds its best among the rest."""
    monkeypatch.setenv(FAULT_ENV, "garble@1:fsdp")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    summary = autotune.tune(
        "tiny",
        device="cpu",
        device_memory="4MiB",
        gpus=2,
        seq_len=128,
        global_batch=32,
        engines=[Engine.DDP, Engine.FSDP],
        losses="full",  # the ladder's engines and checkpointing: what a torn report is about
        optimizers="adamw",
        budget="2m",
        storage=storage,
        trials_dir=tmp_path / "trials",
    )
    assert summary.interrupted is None
    assert summary.best is not None and summary.best.config.engine is Engine.DDP
    fsdp = [m for m in summary.measurements if m.config.engine is Engine.FSDP]
    assert fsdp, "the run never probed FSDP"
    for m in fsdp:
        assert m.state == "FAIL" and m.outcome == "error", m
        assert "rank1.json is not valid JSON" in m.attrs["message"], m.attrs


def test_run_stops_with_one_line_when_no_probe_folder_can_be_made(tmp_path: Path) -> None:
    """``autotune run`` with a trials folder on a read-only file system: the run stops before
    its first probe with one line naming the folder and what to do, no traceback, exit 1 (no
    configuration measured), and the study holds no trial left running."""
    trials = tmp_path / "trials"
    trials.mkdir()
    if ROOT:
        _mount_tmpfs(trials, "ro,size=1m")
    else:
        trials.chmod(0o555)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    try:
        done = subprocess.run(
            [
                *(sys.executable, "-c", "from autotune.cli import main; main()", "run"),
                *("--model", "tiny", "--simulate", "a100-40gb", "--budget", "5m"),
                *("--storage", storage, "--trials-dir", str(trials), "--json"),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        if ROOT:
            subprocess.run(["umount", str(trials)], check=True)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr
    summary = json.loads(done.stdout)
    assert summary["probes"] == 0 and summary["best"] is None
    reason = summary["stop_reason"]
    assert reason.startswith(f"no probe folder can be made in {trials} (")
    assert "choose another --trials-dir" in reason
    assert autotune.trials(storage=storage)[0].measurements == []


def test_a_full_trials_dir_stops_the_run_and_poisons_no_configuration(tmp_path: Path) -> None:
    """The trials folder's disk is full (its folders can be made, no file written): the first
    probe cannot start, the run stops with one line saying so (exit 1, and no "no
    configuration fits"), and the study holds nothing against the configuration. Once there
    is room, the next run probes that very configuration and finds a best."""
    if not ROOT:
        pytest.skip("a full file system needs a tmpfs mount (root)")
    trials = tmp_path / "trials"
    trials.mkdir()
    _mount_tmpfs(trials, "size=64k")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    args = (
        *("run", "--model", "tiny", "--device", "cpu", "--device-memory", "4MiB"),
        *("--seq-len", "32", "--global-batch", "4", "--engine", "single", "--budget", "2m"),
        *("--storage", storage, "--trials-dir", str(trials)),
    )
    try:
        with (trials / "filler").open("wb") as filler, pytest.raises(OSError):
            filler.write(b"x" * (1 << 20))
            filler.flush()
        done = run_autotune(*args, cwd=tmp_path)
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode == 1, done.stdout + done.stderr
        assert "No space left on device" in done.stdout and "free space there" in done.stdout
        assert "no configuration fits" not in done.stdout
        assert "no best: the run stopped on a fault of its own" in done.stdout
        assert autotune.trials(storage=storage)[0].measurements == []
        (trials / "filler").unlink()
        # Room for a whole run (its probes' folders, re-measures included), not the 64 KiB
        # that held the full disk's test.
        subprocess.run(["mount", "-o", "remount,size=16m", str(trials)], check=True)
        again = run_autotune(*args, "--json", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        summary = json.loads(again.stdout)
        assert summary["best"] is not None and summary["probes"] >= 1
    finally:
        subprocess.run(["umount", "-l", str(trials)], check=False)


def test_a_trials_dir_that_is_a_file_fails_the_run_even_with_an_earlier_best(
    tmp_path: Path,
) -> None:
    """A run that still has probes to make, with ``--trials-dir`` naming a regular file,
    stops before its first probe with one line that says a file is in the way, and exits 1
    though the study already holds a best (which it still prints)."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    sim = ("run", "--model", "llama-7b", "--simulate", "h100-80gb", "--storage", storage)
    first = run_autotune(*sim, "--budget", "3m", "--json", cwd=tmp_path)
    assert json.loads(first.stdout)["best"] is not None, first.stderr
    (tmp_path / "afile").write_text("not a folder\n")
    done = run_autotune(*sim, "--budget", "30m", "--trials-dir", "afile", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "no probe folder can be made in afile (Not a directory): a file is in the way: "
        "give --trials-dir a folder" in " ".join(done.stdout.split())
    )
    assert "best: " in done.stdout and (tmp_path / "afile").read_text() == "not a folder\n"


@pytest.mark.parametrize(
    ("request_", "rank", "engine", "label", "kind"),
    [
        ("hang", 1, "ddp", "ddp ac:off", "hang"),
        ("hang@0", 1, "ddp", "ddp ac:off", None),
        ("hang@1:ddp", 1, "ddp", "ddp ac:off", "hang"),
        ("hang@1:fsdp", 1, "ddp", "ddp ac:off", None),
        ("hang@0:single ac:off", 0, "single", "single ac:off", "hang"),
        ("hang@0:single ac:off", 0, "single", "single ac:every", None),
        ("", 0, "single", "single ac:off", None),
    ],
)
def test_a_fault_request_names_its_rank_engine_or_configuration(
    request_: str, rank: int, engine: str, label: str, kind: str | None
) -> None:
    """A request reaches the rank, engine or configuration (its label, colons and all) it
    names, and no other."""
    assert fault_for(request_, rank, engine, label) == kind
