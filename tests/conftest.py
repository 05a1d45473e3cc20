"""Shared fixtures: a ``run_probe`` helper that launches real CPU probes in ``tmp_path``."""

from __future__ import annotations

import os

# numpy's OpenBLAS on one thread before anything imports numpy (the Makefile sets it too):
# two test workers each spinning two BLAS threads on two cores slowed the search's small
# Gaussian-process solves fifteenfold.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import psutil
import pytest

from autotune.config import TrainConfig
from autotune.probe import faults
from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import SubprocessSpawner, launch_probe
from autotune.probe.ops import EXTENSIONS_ENV, op_environment
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

# Every process the suite starts finds DeepSpeed's ops where `make install` built them and
# autotune's probes load them (the environment's folder), built by the environment's own ninja
# first on PATH, as in the activated environment (autotune/probe/ops: op_environment). An
# exported DeepSpeed job run as a user runs it would otherwise JIT-build its CPU op again
# (a minute and more on 2 cores, in whichever test gets there first), and a ninja of another
# build-log format would rebuild it under the next probe. Tests of the build set their own.
_OPS = op_environment(os.environ)
os.environ.update({name: _OPS[name] for name in (EXTENSIONS_ENV, "PATH") if name in _OPS})

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
    "step_times",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "host_rss_bytes",
)


class RunProbe(Protocol):
    """Signature of the ``run_probe`` fixture."""

    def __call__(
        self,
        config: TrainConfig | None = None,
        *,
        name: str = "probe",
        spawner: str = "forkserver",
        **overrides: Any,
    ) -> ProbeResult: ...


SERIAL = (
    "tests/probe/test_faults.py",
    "tests/probe/test_launcher.py",
    "tests/probe/test_lifetime.py",
    "tests/probe/test_nodes.py",
    "tests/probe/test_ops.py",
    "tests/probe/test_warm.py",
    "tests/search/test_run_e2e.py",
)
"""Where real probes and tuners race the clock (probe timeouts, tuners killed once their
ranks run, signals): ``make test`` runs these alone, after the rest has run on both cores
(``-n 2``), so no other test takes their cores. The trial database's faults and PostgreSQL's
workers (tests/study/) run with the rest: their tuners answer from the simulated GPU, on its
clock, and every wait there is bounded by the product's own timeouts, not the test's."""


DURATIONS = Path(__file__).with_name("durations.json")
"""The seconds each test of 4 s or more took in one run of `make test`'s parallel part (a clean
clone's `.ci/run` at 189ec79, 2026-11-29, on 2 cores without AVX-512, other work beside it for
a few minutes): only their order is used."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Each part of ``make test`` collects only its own test files (the serial mark is given
    by file): the serial part then imports 7 modules, not the suite's 200 (13 s of a clean
    clone's run on 2 cores), and the parallel part leaves the serial part's files alone."""
    part = config.option.markexpr
    if part not in ("serial", "not serial") or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    if is_serial(collection_path, config.rootpath) != (part == "serial"):
        return True
    return None


def is_serial(path: Path, root: Path) -> bool:
    """Whether the test file ``path`` is one of ``SERIAL``'s (the mark is given by file)."""
    return path.relative_to(root).as_posix().startswith(SERIAL)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_serial(Path(str(item.path)), config.rootpath):
            item.add_marker(pytest.mark.serial)
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) > 1:  # the parallel part
        items[:] = longest_first(items)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The test files in order of their time (DURATIONS; a test not in it counts 0.3 s, the
    mean of those), the longest first, each file's tests together and in their order (its
    module fixtures are made once). xdist's worksteal hands each worker a contiguous share of
    the list, and an idle worker steals from the end of another's share: so the workers start
    on the long files and the run ends on short tests, not on a long one while the other
    worker idles. The order is the same in every worker, as xdist requires."""
    seconds = json.loads(DURATIONS.read_text())
    totals: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::", 1)[0]
        totals[module] = totals.get(module, 0.0) + seconds.get(item.nodeid, 0.3)
        first.setdefault(module, index)

    def rank(index: int) -> tuple[float, int, int]:
        module = items[index].nodeid.split("::", 1)[0]
        return (-totals[module], first[module], index)

    return [items[i] for i in sorted(range(len(items)), key=rank)]


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal delivers it, however the suite was started: a shell starts a
    background job (``make test &``, ``nohup``) with SIGINT ignored, which its children
    inherit, and the tests that send SIGINT to a tuner or to this process would see nothing."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    faults.arm()  # the tests' AUTOTUNE_TEST_FAULT reaches their probes; a real run's never does


def probe_processes(result: ProbeResult) -> list[psutil.Process]:
    """Live processes left from a probe: in its process group (rank 0 leads it) or with its
    folder on their command line. Forked ranks carry the fork server's command line, so the
    group is the check that holds for every spawner."""
    pgid = result.exits[0]["pid"] if result.exits else None
    needle = str(result.probe_dir)
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            in_group = pgid is not None and os.getpgid(proc.pid) == pgid
            cmdline = proc.info["cmdline"] or []
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
        if in_group or any(needle in part for part in cmdline):
            found.append(proc)
    return found


def kill_tuner_once_ranks_run(
    tuner: subprocess.Popen[bytes], probe_dir: Path, *, ranks: int, processes: int
) -> None:
    """Wait until ``ranks`` ranks of the tuner's probe have built (their reports exist; they
    hang after), SIGKILL the tuner, and assert that its ``processes`` or more descendants
    (ranks, fork servers, node agents) all end within 20 s. Whatever is left is killed, so a
    failure leaves nothing behind."""
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(list(probe_dir.glob("rank*.json"))) < ranks:
            assert tuner.poll() is None, "the tuner ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.2)
        descendants += psutil.Process(tuner.pid).children(recursive=True)
        assert len(descendants) >= processes
        os.kill(tuner.pid, signal.SIGKILL)  # no chance to stop its probe
        tuner.wait()
        _, alive = psutil.wait_procs(descendants, timeout=20)
        assert not alive, f"processes outlived their tuner: {alive}"
    finally:
        if tuner.poll() is None:
            descendants += psutil.Process(tuner.pid).children(recursive=True)
            tuner.kill()
            tuner.wait()
        for proc in descendants:
            if proc.is_running():
                proc.kill()


def exit_summary(exits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Exits without their pids (which differ per run), after checking every pid is real."""
    assert all(isinstance(e["pid"], int) and e["pid"] > 0 for e in exits)
    return [{k: v for k, v in e.items() if k != "pid"} for e in exits]


def read_json(path: Path) -> dict[str, Any]:
    """Parse one JSON file of a probe folder."""
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer]:
    """One fork server for the whole session: probes start in a fraction of a second."""
    with ForkServer() as server:
        yield server


@pytest.fixture
def run_probe(tmp_path: Path, fork_server: ForkServer) -> Iterator[RunProbe]:
    """Launch a real probe in ``tmp_path/<name>`` with CPU-friendly defaults.

    Keyword overrides go to :class:`ProbeSpec`; ``spawner="subprocess"`` starts the ranks as
    fresh interpreters instead of forks of the session's fork server. After the test, no
    process of any probe it launched may be left.
    """
    results: list[ProbeResult] = []

    def run(
        config: TrainConfig | None = None,
        *,
        name: str = "probe",
        spawner: str = "forkserver",
        **overrides: Any,
    ) -> ProbeResult:
        fields = {**PROBE_DEFAULTS, **overrides}
        if config is not None:
            fields["config"] = config
        spec = ProbeSpec(**fields)
        chosen = fork_server if spawner == "forkserver" else SubprocessSpawner()
        result = launch_probe(spec, tmp_path / name, spawner=chosen)
        results.append(result)
        return result

    yield run
    for result in results:
        leftovers = probe_processes(result)
        for proc in leftovers:  # do not leak into later tests, but still fail this one
            proc.kill()
        assert not leftovers, f"processes of {result.probe_dir} outlived the probe: {leftovers}"


def probe_failure_text(result: ProbeResult) -> str:
    """The probe's message plus the tail of its stderr, for assertion messages."""
    stderr = result.probe_dir / "stderr.log"
    tail = stderr.read_text()[-3000:] if stderr.exists() else ""
    return f"{result.outcome.value} at {result.stage}: {result.message}\n--- stderr ---\n{tail}"
