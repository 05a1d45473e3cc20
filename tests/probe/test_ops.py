"""DeepSpeed's JIT-built ops: the arch list DeepSpeed's builder parses, which ops a probe loads,
the build lock, and (slow, real) the build step waiting for a live holder of it."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.config import Engine, Offload, TrainConfig
from autotune.probe.launcher import rank_environment
from autotune.probe.ops import (
    BUILDERS,
    LOCK_NAME,
    BuildLockTimeout,
    build_command,
    build_lock,
    deepspeed_ops,
    library_path,
    normalize_arch_list,
    op_environment,
    pending_ops,
    torch_lock_path,
)
from autotune.probe.spec import ProbeSpec

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


@pytest.fixture(scope="module")
def built(extensions: Path) -> Path:
    """The extensions folder with the shared-memory op built."""
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
    assert lines[-1].startswith("done in ") and f"{SHM}: loaded in " in lines[-1]
    assert not lock.exists() and library.stat().st_mtime_ns == before
