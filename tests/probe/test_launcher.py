"""Tests for autotune.probe.launcher with real worker processes on the CPU.

Covers a successful probe and its files, the emulated device-memory limit (OOM and recovery in
one process, OOM in a two-process DeepSpeed probe), and real rank failures (segfault, SIGKILL,
hang, error) injected with ``AUTOTUNE_TEST_FAULT``. After each probe no process may be left.
"""

from __future__ import annotations

import itertools
import json
import math
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import (
    PROBE_DEFAULTS,
    SIZE_FIELDS,
    RunProbe,
    exit_summary,
    probe_failure_text,
    probe_processes,
    read_json,
)
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from autotune.config import Engine, TrainConfig
from autotune.probe import worker
from autotune.probe.launcher import launch_probe, rank_environment
from autotune.probe.outcome import Outcome, Stage
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec
from autotune.probe.worker import STRAY_MARK

FAULT_ENV = "AUTOTUNE_TEST_FAULT"
DDP = TrainConfig(engine=Engine.DDP)
# Ranks as fresh interpreters (the CLI's default) and as forks of the fork server (the tuner's).
BOTH_SPAWNERS = pytest.mark.parametrize("spawner", ["subprocess", "forkserver"])
DEEPSPEED_Z2 = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2)
# Long enough sequences that activations, not the tiny model's weights, decide the peak.
OOM_SEQ_LEN = 128


def _assert_no_leftovers(result: ProbeResult) -> None:
    leftovers = probe_processes(result)
    assert not leftovers, f"processes of the probe are still alive: {leftovers}"


@BOTH_SPAWNERS
def test_single_process_probe_succeeds_and_writes_everything(
    run_probe: RunProbe, spawner: str
) -> None:
    """One ok probe: every file, every documented size field, sane values, one clean exit."""
    result = run_probe(micro_batch_sizes=(1, 2), spawner=spawner)
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    _assert_no_leftovers(result)
    probe_dir = result.probe_dir
    for name in ("config.json", "cmd.txt", "stdout.log", "stderr.log", "rank0.json", "result.json"):
        assert (probe_dir / name).is_file(), f"{name} missing"
    assert not list(probe_dir.glob("*.tmp"))

    assert ProbeSpec.from_dict(read_json(probe_dir / "config.json")) == result.spec
    cmd = (probe_dir / "cmd.txt").read_text()
    assert "torchrun" in cmd and "autotune.probe.worker" in cmd and str(probe_dir) in cmd
    assert "micro-batch 1" in (probe_dir / "stdout.log").read_text()

    rank0 = read_json(probe_dir / "rank0.json")
    assert rank0["status"] == "ok"
    assert rank0["rank"] == 0 and rank0["world_size"] == 1

    data = read_json(probe_dir / "result.json")
    assert data["outcome"] == "ok"
    assert data["stage"] is None
    assert data["failed_rank"] is None
    assert data["device"] == "cpu"
    assert data["num_params"] > 0
    assert data["import_s"] > 0 and data["build_s"] > 0 and data["wall_s"] > 0
    assert exit_summary(data["exits"]) == [
        {"rank": 0, "returncode": 0, "killed_by_launcher": False, "finished": True}
    ]
    assert [s["micro_batch_size"] for s in data["sizes"]] == [1, 2]
    for size in data["sizes"]:
        missing = [f for f in SIZE_FIELDS if f not in size]
        assert not missing, f"size {size['micro_batch_size']} lacks {missing}"
        assert size["outcome"] == "ok"
        assert size["mfu"] is None and size["hfu"] is None  # no peak FLOP/s on the CPU
        assert size["tokens_per_second"] > 0
        assert size["tokens_per_second_per_rank"] == size["tokens_per_second"]
        assert size["micro_step_s"] > 0 and size["optimizer_step_s"] > 0
        assert size["step_s"] == pytest.approx(size["micro_step_s"] + size["optimizer_step_s"])
        assert size["tokens_per_second"] == pytest.approx(
            size["micro_batch_size"] * PROBE_DEFAULTS["seq_len"] / size["step_s"]
        )
        # each timed step's own seconds, back to back: their sum is the timed window
        times = size["step_times"]
        assert len(times) == PROBE_DEFAULTS["timed_steps"] and min(times) > 0
        assert math.fsum(times) == pytest.approx(size["timed_s"], abs=1e-6)
        losses = size["losses"]
        assert len(losses) == PROBE_DEFAULTS["warmup_steps"] + PROBE_DEFAULTS["timed_steps"]
        assert all(math.isfinite(x) for x in losses)
        assert losses[-1] < losses[0]
        assert 0 < size["peak_allocated_bytes"] == size["peak_reserved_bytes"]
        assert size["host_rss_bytes"] > size["peak_allocated_bytes"]
    assert ProbeResult.read(probe_dir).to_dict() == result.to_dict()


def test_rerun_in_the_same_folder_forgets_stale_reports(run_probe: RunProbe) -> None:
    """A second probe in a used folder does not read the first one's rank reports."""
    run_probe(micro_batch_sizes=(1,), name="again")
    second = run_probe(micro_batch_sizes=(2,), name="again")
    assert second.outcome is Outcome.OK, probe_failure_text(second)
    assert [s.micro_batch_size for s in second.sizes] == [2]


@pytest.fixture(scope="module")
def unlimited_ladder(tmp_path_factory: pytest.TempPathFactory) -> ProbeResult:
    """One unlimited single-process probe at sizes 1, 2, 4, 8 (the memory each needs)."""
    spec = ProbeSpec(
        **{**PROBE_DEFAULTS, "micro_batch_sizes": (1, 2, 4, 8), "seq_len": OOM_SEQ_LEN}
    )
    result = launch_probe(spec, tmp_path_factory.mktemp("ladder") / "probe")
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    return result


def test_peak_memory_grows_with_micro_batch_size(unlimited_ladder: ProbeResult) -> None:
    """Each larger micro-batch needs strictly more memory (activations grow with it)."""
    peaks = [s.peak_allocated_bytes for s in unlimited_ladder.sizes]
    assert [s.micro_batch_size for s in unlimited_ladder.sizes] == [1, 2, 4, 8]
    assert all(a < b for a, b in itertools.pairwise(peaks)), peaks
    assert unlimited_ladder.emulated_limit_bytes is None
    assert all(s.emulated_limit_bytes is None for s in unlimited_ladder.sizes)


def test_emulated_oom_recovers_in_one_process(
    run_probe: RunProbe, unlimited_ladder: ProbeResult
) -> None:
    """Capped a little above what size 1 needs, sizes 8, 4, 2 run out of memory in the forward or
    backward and size 1 then runs fine, all in the same single process."""
    peak1 = unlimited_ladder.sizes[0].peak_allocated_bytes
    peak2 = unlimited_ladder.sizes[1].peak_allocated_bytes
    limit = int(peak1 * 1.15)
    assert limit < peak2, "the cap must fall between sizes 1 and 2 for this test to mean much"

    result = run_probe(
        micro_batch_sizes=(8, 4, 2, 1), seq_len=OOM_SEQ_LEN, device_memory_bytes=limit
    )
    _assert_no_leftovers(result)
    assert [s.micro_batch_size for s in result.sizes] == [8, 4, 2, 1]
    assert [s.outcome for s in result.sizes] == ["oom", "oom", "oom", "ok"], result.sizes
    for size in result.sizes[:3]:
        assert size.stage in (Stage.FORWARD.value, Stage.BACKWARD.value)
        assert "emulated" in size.message
        assert size.emulated_limit_bytes == limit
    ok = result.sizes[3]
    assert all(f in ok.to_dict() for f in SIZE_FIELDS)
    assert 0 < ok.peak_allocated_bytes <= limit
    assert all(math.isfinite(x) for x in ok.losses)
    assert ok.losses[-1] < ok.losses[0]
    # The probe as a whole records that something ran out of memory ...
    assert result.outcome is Outcome.OOM
    assert result.stage in (Stage.FORWARD, Stage.BACKWARD)
    assert result.failed_rank == 0
    # ... yet it was one process that recovered and exited cleanly.
    assert exit_summary(result.exits) == [
        {"rank": 0, "returncode": 0, "killed_by_launcher": False, "finished": True}
    ]
    assert result.ok_sizes() == [ok]
    assert read_json(result.probe_dir / "result.json")["emulated_device_memory_bytes"] == limit


def test_deepspeed_two_processes_over_the_limit_is_oom(run_probe: RunProbe) -> None:
    """A two-rank DeepSpeed ZeRO-2 probe capped between its build and step peaks: oom, with the
    stage, and both ranks gone."""
    common: dict[str, Any] = {
        "micro_batch_sizes": (8,),
        "seq_len": OOM_SEQ_LEN,
        "num_processes": 2,
    }
    free = run_probe(DEEPSPEED_Z2, name="unlimited", **common)
    assert free.outcome is Outcome.OK, probe_failure_text(free)
    build_peak = max(
        read_json(free.probe_dir / f"rank{r}.json")["build_memory"]["peak_allocated_bytes"]
        for r in (0, 1)
    )
    step_peak = free.sizes[0].peak_allocated_bytes
    assert build_peak < step_peak
    limit = (build_peak + step_peak) // 2

    result = run_probe(DEEPSPEED_Z2, name="capped", device_memory_bytes=limit, **common)
    _assert_no_leftovers(result)
    assert result.outcome is Outcome.OOM, probe_failure_text(result)
    assert result.stage in (Stage.FORWARD, Stage.BACKWARD)
    assert "emulated" in result.message
    assert result.failed_rank in (0, 1)
    [size] = result.sizes
    assert size.outcome == "oom"
    assert size.stage in ("forward", "backward")
    assert len(result.exits) == 2
    assert all(e["returncode"] != 0 for e in result.exits)


def _fault_probe(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, fault: str, **overrides: Any
) -> ProbeResult:
    monkeypatch.setenv(FAULT_ENV, fault)
    result = run_probe(DDP, num_processes=2, **overrides)
    monkeypatch.delenv(FAULT_ENV)
    _assert_no_leftovers(result)
    assert len(result.exits) == 2
    assert read_json(result.probe_dir / "result.json")["outcome"] == result.outcome.value
    return result


@BOTH_SPAWNERS
def test_segfault_is_crash(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, spawner: str
) -> None:
    """Rank 1 segfaults: the probe crashed, rank 1 is blamed, SIGSEGV named."""
    result = _fault_probe(run_probe, monkeypatch, "segfault@1", spawner=spawner)
    assert result.outcome is Outcome.CRASH, probe_failure_text(result)
    assert result.failed_rank == 1
    assert "SIGSEGV" in result.message
    assert result.exits[1]["returncode"] == -11
    assert not result.exits[1]["killed_by_launcher"]


@BOTH_SPAWNERS
def test_sigkill_is_host_oom(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, spawner: str
) -> None:
    """Rank 0 is SIGKILLed, not by the launcher: read as the kernel's OOM killer."""
    result = _fault_probe(run_probe, monkeypatch, "sigkill@0", spawner=spawner)
    assert result.outcome is Outcome.HOST_OOM, probe_failure_text(result)
    assert result.failed_rank == 0
    assert result.exits[0]["returncode"] == -9
    assert not result.exits[0]["killed_by_launcher"]


@BOTH_SPAWNERS
def test_hang_is_timeout(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, spawner: str
) -> None:
    """Rank 1 hangs: the launcher kills the whole group at the timeout."""
    result = _fault_probe(run_probe, monkeypatch, "hang@1", spawner=spawner, timeout_s=8.0)
    assert result.outcome is Outcome.TIMEOUT, probe_failure_text(result)
    assert result.wall_s >= 8.0
    assert result.exits[1]["killed_by_launcher"]
    assert result.exits[1]["returncode"] is not None and result.exits[1]["returncode"] < 0


def test_a_rank_that_finished_but_never_exits_is_stopped_and_its_probe_stands(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 measures and reports its size, then never exits (as a process group's teardown
    can hang once the rank that hosted its store is gone): the launcher stops it a few
    seconds after every report says finished, not at the probe's timeout, and the probe's
    measurements stand."""
    result = _fault_probe(run_probe, monkeypatch, "linger@1", timeout_s=120.0)
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    assert [s.outcome for s in result.sizes] == [Outcome.OK]
    assert result.sizes[0].tokens_per_second > 0
    assert exit_summary(result.exits) == [
        {"rank": 0, "returncode": 0, "killed_by_launcher": False, "finished": True},
        {"rank": 1, "returncode": -signal.SIGTERM, "killed_by_launcher": True, "finished": True},
    ]


def test_a_timeout_ends_what_the_ranks_started_in_groups_of_its_own(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank starts a child in a process group of its own (as ninja starts each
    compiler of an op build) and hangs: at the timeout the launcher ends the children too,
    not only the ranks' group."""
    result = _fault_probe(run_probe, monkeypatch, "stray", timeout_s=15.0)
    assert result.outcome is Outcome.TIMEOUT, probe_failure_text(result)
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if STRAY_MARK in (p.info["cmdline"] or []) and str(result.probe_dir) in p.info["cmdline"]
    ]
    assert not left, f"the ranks' children outlived the probe: {left}"


@BOTH_SPAWNERS
def test_error_is_error_with_message(
    run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch, spawner: str
) -> None:
    """Rank 0 raises: the probe is an error in the forward with the injected message."""
    result = _fault_probe(run_probe, monkeypatch, "error@0", spawner=spawner)
    assert result.outcome is Outcome.ERROR, probe_failure_text(result)
    assert result.failed_rank == 0
    assert result.stage is Stage.FORWARD
    assert "injected failure (AUTOTUNE_TEST_FAULT)" in result.message
    rank0 = read_json(result.probe_dir / "rank0.json")
    assert rank0["status"] == "error"
    assert "injected failure" in rank0["traceback"]
    [size] = result.sizes
    assert size.outcome == "error"


def test_fault_in_single_process(run_probe: RunProbe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same hook in a single-process probe: a segfault is a crash there too."""
    monkeypatch.setenv(FAULT_ENV, "segfault")
    result = run_probe()
    _assert_no_leftovers(result)
    assert result.outcome is Outcome.CRASH, probe_failure_text(result)
    assert exit_summary(result.exits) == [
        {"rank": 0, "returncode": -11, "killed_by_launcher": False, "finished": False}
    ]


def test_build_failure_is_error_in_build(run_probe: RunProbe, tmp_path: Path) -> None:
    """An unknown model fails in the build stage, reported as an error with the reason."""
    result = run_probe(model=str(tmp_path / "no-such-model"))
    _assert_no_leftovers(result)
    assert result.outcome is Outcome.ERROR, probe_failure_text(result)
    assert result.stage is Stage.BUILD
    assert result.sizes == []
    assert result.message


def test_startup_failure_is_reported_with_its_stage(run_probe: RunProbe) -> None:
    """A rank that cannot even pick its device reports an error at startup (here: cuda
    without a GPU, asked for past the CLI's own check)."""
    result = run_probe(device="cuda")
    _assert_no_leftovers(result)
    assert result.outcome is Outcome.ERROR, probe_failure_text(result)
    assert result.stage is Stage.STARTUP
    assert "no GPU is visible" in result.message
    assert result.device == "cuda"
    assert read_json(result.probe_dir / "rank0.json")["status"] == "error"


@pytest.mark.parametrize("builds", [True, False], ids=["ok", "build-error"])
def test_worker_exits_its_tensor_counter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, builds: bool
) -> None:
    """A CPU rank run in this process leaves its tensor byte counter exited however it ends:
    no dispatch mode left on the stack, ``UntypedStorage.resize_`` the original again."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", FAULT_ENV):
        monkeypatch.delenv(name, raising=False)
    model = "tiny" if builds else str(tmp_path / "no-such-model")
    spec = ProbeSpec(**{**PROBE_DEFAULTS, "model": model, "device_memory_bytes": 2**30})
    (tmp_path / "config.json").write_text(json.dumps(spec.to_dict()))
    resize = torch.UntypedStorage.resize_
    threads = torch.get_num_threads()
    try:
        code = worker.run(tmp_path)
    finally:
        torch.set_num_threads(threads)
    report = read_json(tmp_path / "rank0.json")
    assert (code, report["status"]) == ((0, "ok") if builds else (1, "error")), report
    assert report["stage"] == (None if builds else Stage.BUILD.value)
    assert _get_current_dispatch_mode_stack() == []
    assert torch.UntypedStorage.resize_ is resize


def test_each_python_environment_gets_its_own_deepspeed_op_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = ProbeSpec(model="tiny")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    env = rank_environment(spec, 0, 29500)
    assert env["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/srv/ops")
    assert rank_environment(spec, 0, 29500)["TORCH_EXTENSIONS_DIR"] == "/srv/ops"
