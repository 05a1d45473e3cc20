"""Warm probe workers: `autotune run` forks its ranks from a process that imported torch once,
restarts it when it has gone stale, and falls back to fresh interpreters when it fails."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from autotune.config import TrainConfig
from autotune.devices import LocalDevice
from autotune.probe.forkserver import WarmWorkers, cuda_driver_initialized
from autotune.probe.outcome import Outcome
from autotune.probe.spec import ProbeSpec
from tests.conftest import PROBE_DEFAULTS

MODULE = "autotune_warm_probe_module"


def test_no_cuda_driver_means_not_initialized() -> None:
    """On a host without a CUDA driver (this one) the guard must not call CUDA initialized:
    it would turn warm workers off everywhere."""
    assert not cuda_driver_initialized()


def _set_up(device: LocalDevice, spec: ProbeSpec) -> list[tuple[str, bool, str]]:
    """Run the device's set-up steps; (label, ok, message) of each."""
    done = [step.run() for step in device.setup(spec)]
    return [(d.label, d.ok, d.message) for d in done]


def test_a_stale_warm_process_is_restarted_before_the_next_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module the warm process imported changes on disk (an upgrade during a nightly run),
    or an environment variable imports read does: the next set-up restarts it, and the
    probe after that forks from the new one."""
    module = tmp_path / "lib" / f"{MODULE}.py"
    module.parent.mkdir()
    module.write_text("VALUE = 1\n")
    monkeypatch.setenv(
        "PYTHONPATH", f"{module.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    device = LocalDevice("cpu")
    assert device.warm is not None
    device.warm = WarmWorkers(preload=(MODULE,))
    spec = ProbeSpec(**PROBE_DEFAULTS, config=TrainConfig(engine="single"))
    try:
        [(label, ok, message)] = _set_up(device, spec)
        assert (label, ok) == ("starting warm probe workers", True), message
        assert "ranks fork from it" in message
        first = device.warm.pid
        assert device.setup(spec) == []  # nothing changed: nothing to do

        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
        [step] = device.setup(spec)
        assert step.label == "restarting warm probe workers: CUDA_VISIBLE_DEVICES changed"
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
        assert device.setup(spec) == []

        time.sleep(0.01)
        module.write_text("VALUE = 2\n")
        [(label, ok, _)] = _set_up(device, spec)
        assert label == f"restarting warm probe workers: {module} changed"
        assert ok and device.warm.pid not in (None, first)
        assert not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie"
        assert device.setup(spec) == []

        result = device.launch(spec, tmp_path / "probe")
        assert result.outcome is Outcome.OK, result.message
        assert result.spawn == "warm"
    finally:
        device.close()
    assert device.warm.pid is None


def test_ranks_start_fresh_when_the_warm_process_is_gone(tmp_path: Path) -> None:
    """The warm process dies between probes (killed by the OOM killer, say): the probe runs
    at once with fresh interpreters, its log says why, and so does the rest of the run."""
    device = LocalDevice("cpu")
    spec = ProbeSpec(**PROBE_DEFAULTS, config=TrainConfig(engine="single"))
    try:
        [(_, ok, message)] = _set_up(device, spec)
        assert ok, message
        assert device.warm is not None and device.warm.pid is not None
        os.kill(device.warm.pid, signal.SIGKILL)
        result = device.launch(spec, tmp_path / "probe")
        assert result.outcome is Outcome.OK, result.message
        assert result.spawn == "fresh"
        log = (tmp_path / "probe" / "stderr.log").read_text()
        assert "the ranks start again as fresh interpreters" in log
        # For the rest of the run: no second try, fresh interpreters.
        assert device.warm.off is not None
        assert device.setup(spec) == []
        assert device.warm.spawner.kind == "fresh"
    finally:
        device.close()
