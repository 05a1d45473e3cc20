"""torch's build lock of a DeepSpeed op (the ``lock`` file torch creates, keeps open and
deletes around each build or load of an op), for real: in a real extensions folder, with the
shared-memory op built there (copied from the default folder, where it is built once), real
processes holding the lock, and real loads through DeepSpeed's builder.

- A lock that a live process holds is waited for, never removed, and the wait ends after its
  bound with one line naming the file and the holder.
- A lock whose holder is killed while autotune waits is then stale: removed with one line
  naming it, and the op loads without being compiled again.
- torch's own wait on a lock (which has no end) is bounded while autotune loads ops.
- A DeepSpeed script probed without a set-up step before it, a stale lock in its extensions
  folder: the measurement layer loads the op under autotune's build lock before the script
  runs, removing the stale lock, and the job is measured, as DeepSpeed's engine (torch's wait
  in the script's DeepSpeed would otherwise hang it until the probe's timeout).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.config import Engine, TrainConfig
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.ops import (
    BuildLockTimeout,
    bounded_torch_waits,
    build_command,
    extensions_dir,
    library_path,
    torch_lock_path,
)
from autotune.probe.outcome import Outcome
from autotune.probe.scriptprobe import launch_script_probe
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import ScriptJob
from tests.probe.test_userjob_engine import ENGINE_SCRIPT

SHM = "deepspeed_shm_comm"

HOLD = (
    "import os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)  # as torch's FileBaton takes it\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


@pytest.fixture(scope="module")
def built_once() -> Path:
    """The default extensions folder with the shared-memory op built: nothing to do where
    earlier probes built it (the build step imports nothing then); a minute otherwise."""
    directory = extensions_dir(os.environ)
    done = subprocess.run(
        build_command([SHM], directory), capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return directory


@pytest.fixture
def extensions(tmp_path: Path, built_once: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``TORCH_EXTENSIONS_DIR`` of this test's own with the op built (its build folder
    copied with its times, so ninja finds it up to date)."""
    directory = tmp_path / "torch_extensions"
    shutil.copytree(built_once / SHM, directory / SHM, ignore=shutil.ignore_patterns("lock"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory))
    return directory


@pytest.fixture
def holder(extensions: Path) -> Iterator[subprocess.Popen[str]]:
    """A live process holding the op's torch lock open, as torch's holder does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(torch_lock_path(extensions, SHM))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_lock_a_live_process_holds_is_waited_for_and_never_removed(
    extensions: Path, holder: subprocess.Popen[str]
) -> None:
    lock = torch_lock_path(extensions, SHM)
    done = subprocess.run(
        build_command([SHM], extensions, wait_s=1.0),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith(
        f"error: gave up after 1 s waiting for torch's build lock {lock}, held by pid "
        f"{holder.pid} ("
    ), lines
    assert lines[-1].endswith(": run again once it is done, or stop it")
    assert [line for line in lines if line.startswith("waiting for torch's build lock")]
    assert lock.exists() and holder.poll() is None


def test_a_lock_whose_holder_is_killed_meanwhile_is_removed_and_the_op_loads(
    extensions: Path, holder: subprocess.Popen[str]
) -> None:
    lock, library = torch_lock_path(extensions, SHM), library_path(extensions, SHM)
    before = library.stat().st_mtime_ns
    step = subprocess.Popen(
        build_command([SHM], extensions, wait_s=120),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert step.stdout is not None
        line = ""
        while not line.startswith("waiting for torch's build lock"):
            line = step.stdout.readline()
            assert line, "the build step ended without waiting for the holder"
        assert line.startswith(f"waiting for torch's build lock {lock}, held by pid {holder.pid}")
        holder.send_signal(signal.SIGKILL)  # killed while holding it: the lock stays
        rest, _ = step.communicate(timeout=120)
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()
    assert step.returncode == 0, rest
    lines = rest.strip().splitlines()
    assert [line for line in lines if line.startswith(f"warning: removed a stale lock {lock} ")]
    assert lines[-1].startswith(f"{SHM}: loaded in "), lines  # found built: not compiled
    assert not lock.exists() and library.stat().st_mtime_ns == before


def test_torchs_own_wait_on_a_lock_is_bounded_while_autotune_loads_ops(
    extensions: Path, holder: subprocess.Popen[str]
) -> None:
    from torch.utils.file_baton import FileBaton

    lock = torch_lock_path(extensions, SHM)
    said: list[str] = []
    own = FileBaton.wait
    with bounded_torch_waits(may_remove=True, wait_s=0.5, say=said.append):
        with pytest.raises(BuildLockTimeout, match=f"waiting for torch's build lock {lock}, held"):
            FileBaton(str(lock)).wait()
        holder.kill()
        holder.wait()
        FileBaton(str(lock)).wait()  # now stale, and this holds the lock: removed
    assert FileBaton.wait is own
    assert not lock.exists()
    assert said[0].startswith(f"waiting for torch's build lock {lock}, held by pid {holder.pid}")
    assert said[-1].startswith(f"warning: removed a stale lock {lock} ")


def test_a_deepspeed_script_past_a_stale_lock_is_measured_without_a_set_up_step(
    tmp_path: Path, extensions: Path, fork_server: ForkServer
) -> None:
    """No set-up step ran before the probe (as after a failed one): the layer loads the op
    under the build lock before the script, so DeepSpeed in the script reuses it."""
    lock, library = torch_lock_path(extensions, SHM), library_path(extensions, SHM)
    before = library.stat().st_mtime_ns
    lock.touch()  # left by a script killed while its DeepSpeed loaded the op
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(resolve_model("tiny").config)))
    script = tmp_path / "engines.py"
    script.write_text(ENGINE_SCRIPT)
    spec = ProbeSpec(
        model=str(model),
        script=ScriptJob.read(script, "torchrun", ["--model", str(model)]),
        config=TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1),
        micro_batch_sizes=(2,),
        seq_len=64,
        device="cpu",
        warmup_steps=1,
        timed_steps=2,
        timeout_s=120.0,
    )
    result = launch_script_probe(spec, tmp_path / "probe", warm=fork_server)
    assert result.outcome is Outcome.OK, result.message
    assert result.sizes[0].extra["wrapper"] == "DeepSpeed's engine at ZeRO stage 1"
    log = (tmp_path / "probe" / "mb2" / "stdout.log").read_text()
    assert f"autotune: warning: removed a stale lock {lock} " in log
    assert not lock.exists() and library.stat().st_mtime_ns == before
