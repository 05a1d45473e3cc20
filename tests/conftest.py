"""Shared fixtures: a ``run_probe`` helper that launches real CPU probes in ``tmp_path``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import psutil
import pytest

from autotune.config import TrainConfig
from autotune.probe.launcher import launch_probe
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

# CPU-friendly defaults: a probe of the tiny model takes a few seconds per process.
PROBE_DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "micro_batch_sizes": (2,),
    "seq_len": 32,
    "num_processes": 1,
    "device": "cpu",
    "warmup_steps": 1,
    "timed_steps": 2,
    "timeout_s": 240.0,
}

# Every field result.json documents for one micro-batch size that ran to completion.
SIZE_FIELDS: tuple[str, ...] = (
    "micro_batch_size",
    "outcome",
    "tokens_per_second",
    "tokens_per_second_per_rank",
    "micro_step_s",
    "optimizer_step_s",
    "step_s",
    "mfu",
    "hfu",
    "losses",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "host_rss_bytes",
)


class RunProbe(Protocol):
    """Signature of the ``run_probe`` fixture."""

    def __call__(
        self, config: TrainConfig | None = None, *, name: str = "probe", **overrides: Any
    ) -> ProbeResult: ...


def probe_processes(probe_dir: Path) -> list[psutil.Process]:
    """Live processes whose command line mentions ``probe_dir`` (the probe's ranks)."""
    needle = str(probe_dir)
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(needle in part for part in cmdline):
            found.append(proc)
    return found


def read_json(path: Path) -> dict[str, Any]:
    """Parse one JSON file of a probe folder."""
    return json.loads(path.read_text())


@pytest.fixture
def run_probe(tmp_path: Path) -> Iterator[RunProbe]:
    """Launch a real probe in ``tmp_path/<name>`` with CPU-friendly defaults.

    Keyword overrides go to :class:`ProbeSpec`. After the test, no process of any probe it
    launched may be left.
    """
    launched: list[Path] = []

    def run(
        config: TrainConfig | None = None, *, name: str = "probe", **overrides: Any
    ) -> ProbeResult:
        fields = {**PROBE_DEFAULTS, **overrides}
        if config is not None:
            fields["config"] = config
        spec = ProbeSpec(**fields)
        probe_dir = tmp_path / name
        launched.append(probe_dir)
        return launch_probe(spec, probe_dir)

    yield run
    for probe_dir in launched:
        leftovers = probe_processes(probe_dir)
        for proc in leftovers:  # do not leak into later tests, but still fail this one
            proc.kill()
        assert not leftovers, f"processes of {probe_dir} outlived the probe: {leftovers}"


def probe_failure_text(result: ProbeResult) -> str:
    """The probe's message plus the tail of its stderr, for assertion messages."""
    stderr = result.probe_dir / "stderr.log"
    tail = stderr.read_text()[-3000:] if stderr.exists() else ""
    return f"{result.outcome.value} at {result.stage}: {result.message}\n--- stderr ---\n{tail}"
