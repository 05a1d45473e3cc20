"""DeepSpeed's JIT-built ops: the arch list DeepSpeed's builder parses, which ops a probe loads,
the build lock, and (slow, real) a build killed inside a probe that ``autotune run``'s set-up
step clears and finishes before the next probe, which then builds nothing itself."""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import PROBE_DEFAULTS, probe_failure_text
from rich.console import Console

from autotune.api import prepare
from autotune.config import Engine, Offload, TrainConfig
from autotune.devices import LocalDevice
from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import ProcessHandle, launch_probe, rank_environment
from autotune.probe.ops import (
    BUILDERS,
    LOCK_NAME,
    BuildLockTimeout,
    build_command,
    build_lock,
    deepspeed_ops,
    environment_ninja,
    library_path,
    normalize_arch_list,
    op_environment,
    pending_ops,
    torch_lock_path,
)
from autotune.probe.outcome import Outcome
from autotune.probe.spec import ProbeSpec
from autotune.report.live import RunView
from autotune.search.controller import Event

SHM = "deepspeed_shm_comm"
DEEPSPEED = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1)

# Values of TORCH_CUDA_ARCH_LIST seen on GPU images (torch accepts them all), and what
# DeepSpeed's builder is given instead.
ARCH_LISTS = [
    ("9.0a", "9.0"),
    ("9.0", "9.0"),
    ("9.0+PTX", "9.0+PTX"),
    ("9.0a+PTX", "9.0+PTX"),
    ("10.0a", "10.0"),
    ("9.0f", "9.0"),
    ("8.0 8.6 9.0a", "8.0;8.6;9.0"),
    ("8.0;8.6;9.0a;10.0f+PTX", "8.0;8.6;9.0;10.0+PTX"),
    ("9.0;9.0a", "9.0"),
    ("9.0a;9.0+PTX", "9.0+PTX"),
    (" 7.5 ;; 8.0 ", "7.5;8.0"),
    ("12.0f;8.9", "12.0;8.9"),
    ("native", None),
    ("Hopper", None),
    ("", None),
]


@pytest.mark.parametrize(("raw", "expected"), ARCH_LISTS)
def test_the_arch_list_is_normalized_in_order_without_suffixes_or_repeats(
    raw: str, expected: str | None
) -> None:
    assert normalize_arch_list(raw) == expected


@pytest.mark.parametrize("jit", [False, True], ids=["setup-py", "jit"])
@pytest.mark.parametrize("raw", [raw for raw, expected in ARCH_LISTS if expected])
def test_deepspeed_parses_the_normalized_arch_list_and_not_every_raw_one(
    raw: str, jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's own parser, ``CUDAOpBuilder.compute_capability_args`` (called by every
    CUDA op build), on fused Adam's builder. With a non-empty list it needs no GPU. ``jit``
    sets what ``OpBuilder.jit_load`` sets before building (``jit_mode`` and the list it
    captured from the environment); otherwise the cross-compiling path of ``setup.py`` runs.
    Raw values with an arch suffix fail there exactly as on a Hopper image."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    def parse(value: str) -> str:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        builder = FusedAdamBuilder()
        builder.jit_mode = jit
        builder._jit_arch_list = value.strip() if jit else None
        builder.compute_capability_args()
        return os.environ["TORCH_CUDA_ARCH_LIST"]  # rewritten by DeepSpeed: what torch builds

    normalized = normalize_arch_list(raw)
    assert normalized is not None
    built_for = parse(normalized)
    assert [a.removesuffix("+PTX") for a in built_for.split(";")] == sorted(
        (a.removesuffix("+PTX") for a in normalized.split(";")),
        key=lambda a: tuple(map(int, a.split("."))),
    )
    if any(c.isalpha() for c in raw.replace("+PTX", "")):
        with pytest.raises(ValueError, match="invalid literal for int"):
            parse(raw)


def test_ranks_and_the_build_step_get_a_parsable_arch_list_only_where_one_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = ProbeSpec(model="tiny")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0 9.0a+PTX")
    assert rank_environment(spec, 0, 29500)["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "native")
    assert "TORCH_CUDA_ARCH_LIST" not in rank_environment(spec, 0, 29500)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "TORCH_CUDA_ARCH_LIST" not in rank_environment(spec, 0, 29500)
    assert op_environment({"TORCH_EXTENSIONS_DIR": "/srv/ops"})["TORCH_EXTENSIONS_DIR"] == (
        "/srv/ops"
    )
    assert op_environment({})["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / "torch_extensions")


def test_builds_run_the_environments_own_ninja_first_on_the_path() -> None:
    """DeepSpeed requires pip's ninja, installed beside this interpreter: every process that
    may build an op finds it first on PATH, once (the rest of PATH kept in order)."""
    ninja = environment_ninja()
    assert ninja is not None and ninja.parent == Path(sys.executable).parent
    env = op_environment({"PATH": f"/usr/bin{os.pathsep}/bin"})
    assert env["PATH"].split(os.pathsep) == [str(ninja.parent), "/usr/bin", "/bin"]
    assert op_environment(env)["PATH"] == env["PATH"]
    assert op_environment({})["PATH"] == str(ninja.parent)


def test_the_ops_a_probe_loads_follow_the_engine_the_device_and_the_offload() -> None:
    offload = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, offload=Offload.OPTIMIZER)
    params = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, offload=Offload.PARAMS)
    assert deepspeed_ops(DEEPSPEED, "cpu") == (SHM,)
    assert deepspeed_ops(offload, "cpu") == (SHM,)  # torch's AdamW on the CPU
    assert deepspeed_ops(DEEPSPEED, "cuda") == ("fused_adam",)
    assert deepspeed_ops(offload, "cuda") == ("cpu_adam",)
    assert deepspeed_ops(params, "cuda") == ("cpu_adam",)
    for engine in (Engine.SINGLE, Engine.DDP, Engine.FSDP):
        zero = 2 if engine is Engine.FSDP else 0
        assert deepspeed_ops(TrainConfig(engine=engine, zero_stage=zero), "cuda") == ()
    assert set(BUILDERS) == {SHM, "cpu_adam", "fused_adam"}


def test_an_op_is_pending_until_built_and_again_while_a_torch_lock_is_there(
    tmp_path: Path,
) -> None:
    assert pending_ops([SHM], tmp_path) == [SHM]
    library_path(tmp_path, SHM).parent.mkdir()
    library_path(tmp_path, SHM).touch()
    assert pending_ops([SHM], tmp_path) == []
    torch_lock_path(tmp_path, SHM).touch()
    assert pending_ops([SHM], tmp_path) == [SHM]


def test_shared_holders_coexist_and_an_exclusive_one_gives_up_after_its_bound(
    tmp_path: Path,
) -> None:
    said: list[str] = []
    first = build_lock(tmp_path, exclusive=False, wait_s=1)
    second = build_lock(tmp_path, exclusive=False, wait_s=1)
    exclusive = build_lock(tmp_path, exclusive=True, wait_s=0.3, say=said.append)
    timeout = pytest.raises(BuildLockTimeout, match=r"gave up after 0\.3 s")
    with first, second, timeout, exclusive:
        pass
    assert len(said) == 1 and said[0].startswith("waiting for another process")
    with build_lock(tmp_path, exclusive=True, wait_s=0):  # released: free at once
        pass


def _hold(directory: Path) -> int:
    """Take the build lock of ``directory`` in this process; returns the descriptor."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_the_build_step_gives_up_on_a_live_holder_with_one_line(tmp_path: Path) -> None:
    """The op is missing, another live process holds the lock: the step waits ``--wait``
    seconds, then ends with status 3 and one line naming the holder, before loading torch."""
    fd = _hold(tmp_path)
    try:
        done = subprocess.run(
            build_command([SHM], tmp_path, wait_s=1.0),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(fd)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("error: gave up after 1 s waiting for the DeepSpeed op build")
    assert f"held by pid {os.getpid()} " in lines[-1]
    assert any(line.startswith("waiting for another process") for line in lines)
    assert "accelerator" not in done.stdout + done.stderr  # DeepSpeed was never imported
    assert not library_path(tmp_path, SHM).exists()


def test_the_build_step_does_nothing_without_torch_when_every_op_is_built(
    tmp_path: Path,
) -> None:
    library_path(tmp_path, SHM).parent.mkdir()
    library_path(tmp_path, SHM).touch()
    code = (
        "import sys; from autotune.probe.ops.__main__ import main; "
        f"code = main(['build', '--dir', {str(tmp_path)!r}, {SHM!r}]); "
        "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules), code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"nothing to build: {SHM} built in {tmp_path}", "[] 0"]


def test_ctrl_c_during_the_set_up_step_stops_its_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C reaches the tuner (the step runs in a process group of its own), which ends
    the step's process before the interruption goes on (here: while it waits for a holder)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    spec = ProbeSpec(**{**PROBE_DEFAULTS, "config": DEEPSPEED, "num_processes": 2})
    [step] = LocalDevice("cpu", warm=False, build_wait_s=120).setup(spec)
    fd = _hold(tmp_path)
    main = threading.get_ident()

    def ctrl_c() -> None:
        while not _naming(tmp_path):
            time.sleep(0.05)
        time.sleep(0.3)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            step.run()
    finally:
        os.close(fd)
    assert not _naming(tmp_path), "the set-up step's process outlived the interruption"


def test_a_failed_build_is_one_line_with_its_log_and_is_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real build that fails (the compiler named by ``CXX`` fails): the step says why in
    one line and keeps its output; the device does not offer the same build again (the probes
    then build, or fail, themselves, as without the step)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    spec = ProbeSpec(**{**PROBE_DEFAULTS, "config": DEEPSPEED, "num_processes": 2})
    device = LocalDevice("cpu", warm=False)
    [step] = device.setup(spec)
    done = step.run()
    assert not done.ok
    assert done.message.startswith(f"error: building {SHM} failed: ")
    assert "\n" not in done.message
    log = Path(done.message.rsplit("output in ", 1)[1].rstrip(")"))
    assert log.is_file() and "Traceback" in log.read_text()
    assert device.setup(spec) == []


def _naming(path: Path) -> list[psutil.Process]:
    """This process's live children (zombies left out) with ``path`` on their command line."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and str(path) in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


# ---------------------------------------------------------------------------------------------
# Real builds (one shared by the tests below: it takes about a minute on 2 cores)


@pytest.fixture(scope="module")
def extensions(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh ``TORCH_EXTENSIONS_DIR`` for this module's probes and build steps (the launcher
    and the device read it from the environment)."""
    directory = tmp_path_factory.mktemp("torch_extensions")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(directory))
        yield directory


class _Recording:
    """Starts ranks through another spawner and keeps their pids (rank 0 leads the group)."""

    kind = "warm"

    def __init__(self, inner: ForkServer) -> None:
        self.inner = inner
        self.pids: list[int] = []

    def spawn(
        self, probe_dir: Path, env: dict[str, str], stdout: Path, stderr: Path, process_group: int
    ) -> ProcessHandle:
        handle = self.inner.spawn(probe_dir, env, stdout, stderr, process_group)
        self.pids.append(handle.pid)
        return handle


def _working_in(folder: Path) -> list[psutil.Process]:
    """Live processes whose working directory is ``folder``."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE and Path(proc.cwd()) == folder.resolve():
                found.append(proc)
    return found


COMPILERS = {"ninja", "c++", "g++", "gcc", "cc1plus", "cc", "ld", "collect2"}


def _compiling(pgid: int) -> bool:
    """Whether a compiler runs in the process group ``pgid``."""
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] in COMPILERS and os.getpgid(proc.pid) == pgid:
                return True
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return False


@dataclass(frozen=True)
class KilledBuild:
    directory: Path
    outcome: Outcome


@pytest.fixture(scope="module")
def killed_build(
    extensions: Path, fork_server: ForkServer, tmp_path_factory: pytest.TempPathFactory
) -> KilledBuild:
    """A real two-rank DeepSpeed probe on the CPU, its process group SIGKILLed while its rank
    compiles the shared-memory op (as a timeout, a scheduler or a Ctrl-C would)."""
    spec = ProbeSpec(**{**PROBE_DEFAULTS, "config": DEEPSPEED, "num_processes": 2})
    spawner = _Recording(fork_server)
    outcomes: list[Outcome] = []
    probe_dir = tmp_path_factory.mktemp("killed") / "probe"

    def probe() -> None:
        outcomes.append(launch_probe(spec, probe_dir, spawner=spawner).outcome)

    thread = threading.Thread(target=probe)
    thread.start()
    deadline = time.monotonic() + 180
    while not (
        spawner.pids and torch_lock_path(extensions, SHM).exists() and _compiling(spawner.pids[0])
    ):
        assert thread.is_alive(), "the probe ended before it built anything"
        assert time.monotonic() < deadline, "the probe never started compiling"
        time.sleep(0.05)
    os.killpg(spawner.pids[0], signal.SIGKILL)
    thread.join(timeout=60)
    assert outcomes, "the launcher did not return after its ranks were killed"
    return KilledBuild(directory=extensions, outcome=outcomes[0])


@pytest.mark.slow
def test_a_build_killed_in_a_probe_is_finished_by_the_set_up_step_not_the_next_probe(
    killed_build: KilledBuild, fork_server: ForkServer, tmp_path: Path
) -> None:
    """``autotune run``'s path (prepare, the controller, a local CPU device): the killed
    probe's torch lock is removed with a warning, the op is built as a step of its own before
    the first probe, and that probe finishes ok without building anything."""
    directory = killed_build.directory
    lock, library = torch_lock_path(directory, SHM), library_path(directory, SHM)
    assert killed_build.outcome is not Outcome.OK
    assert lock.exists() and not library.exists(), "the killed probe left no stale lock"

    tuning = prepare(
        "tiny", budget="20m", seq_len=32, global_batch=4, gpus=2, engines=[Engine.DEEPSPEED],
        device=LocalDevice("cpu", spawner=fork_server), device_memory="1GiB",
        storage=f"sqlite:///{tmp_path}/t.db", trials_dir=tmp_path / "trials",
        warmup_steps=1, timed_steps=2,
    )  # fmt: skip
    out = io.StringIO()
    view = RunView(Console(file=out, width=200, color_system=None), budget_s=1200, simulated=False)
    events: list[Event] = []
    at_probe: list[os.stat_result] = []

    def watch(event: Event) -> None:
        events.append(event)
        view(event)
        if event.kind == "probe":
            at_probe.append(library.stat())
        if event.kind == "result":
            raise KeyboardInterrupt("one probe is enough")  # as a Ctrl-C would stop the run

    summary = tuning.run(watch)
    assert [e.kind for e in events] == ["setup", "setup_done", "probe", "result", "stop"]
    done = events[1].setup
    assert done is not None and done.ok, done
    assert done.label == f"building DeepSpeed ops: {SHM}"
    [warning] = done.warnings
    assert warning.startswith(f"warning: removed a stale lock {lock} ")
    assert not lock.exists() and library.is_file()
    assert SHM in done.message and "built in" in done.message
    # The killed build's compilers (ninja starts each in a process group of its own, so the
    # probe's kill missed them) were ended before the step built: none works there now.
    assert not _working_in(lock.parent), _working_in(lock.parent)

    result = events[3].result
    assert result is not None and result.outcome is Outcome.OK, probe_failure_text(result)
    # The probe loaded what the set-up step built: the library is the one it found, and the
    # probe's log has no build of its own.
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (at_probe[0].st_ino, at_probe[0].st_mtime_ns)
    assert "built in" not in (result.probe_dir / "stdout.log").read_text()
    # Only what deepspeed_ops says a CPU probe loads was built.
    built = {p.name for p in directory.iterdir() if p.is_dir()}
    assert built == set(deepspeed_ops(DEEPSPEED, "cpu"))
    # The run reports the step (the --json summary), and the live view gave it its own lines.
    assert summary.setups == [done]
    assert summary.to_dict()["setup"] == [done.to_dict()]
    log = out.getvalue()
    assert f"set-up: building DeepSpeed ops: {SHM}" in log
    assert "  warning: removed a stale lock " in log and "  done in " in log
    # Before the next DeepSpeed probe there is nothing left to set up.
    assert tuning.device.setup(result.spec) == []


@pytest.fixture(scope="module")
def built(extensions: Path) -> Path:
    """The extensions folder with the shared-memory op built (by the test above, normally)."""
    done = subprocess.run(
        build_command([SHM], extensions), capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return extensions


@pytest.mark.slow
def test_the_build_step_waits_for_a_live_holder_then_clears_a_stale_lock(built: Path) -> None:
    """A torch lock is there (a probe killed while loading), and another process holds the
    build lock: the step says it waits, and once the lock is free, removes the torch lock
    and loads the op, which was built: nothing is compiled again."""
    lock, library = torch_lock_path(built, SHM), library_path(built, SHM)
    before = library.stat().st_mtime_ns
    lock.touch()
    fd = _hold(built)
    step = subprocess.Popen(
        build_command([SHM], built, wait_s=120),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert step.stdout is not None
        waiting = ""
        while not waiting.startswith("waiting for"):
            waiting = step.stdout.readline()
            assert waiting, "the build step ended without waiting"
        assert f"held by pid {os.getpid()} " in waiting
        assert step.poll() is None
    finally:
        os.close(fd)
    rest, _ = step.communicate(timeout=120)
    assert step.returncode == 0, rest
    lines = rest.strip().splitlines()
    assert any(line.startswith(f"warning: removed a stale lock {lock} ") for line in lines)
    assert lines[-1].startswith(f"{SHM}: loaded in ")  # checked by ninja, not compiled
    assert not lock.exists() and library.stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_job_in_the_activated_environment_loads_the_built_op_without_compiling(
    built: Path,
) -> None:
    """A user's job (an exported run) in the activated environment, its bin folder first on
    PATH, loads the op the build step built through DeepSpeed's own builder: nothing is
    compiled again. (A build by a system ninja of another build-log format, 1.11 against
    pip's 1.13, made every such load rebuild the op: a minute and more on 2 cores.)"""
    library = library_path(built, SHM)
    before = library.stat().st_mtime_ns
    folders = [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(built), "PATH": os.pathsep.join(folders)}
    load = (
        "from deepspeed.accelerator import get_accelerator; "
        f"get_accelerator().create_op_builder({BUILDERS[SHM]!r}).load(verbose=False)"
    )
    done = subprocess.run(
        [sys.executable, "-c", load], env=env, capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert library.stat().st_mtime_ns == before
