"""A tuner killed outright leaves no probe behind: its ranks (and fork server) die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

TUNER = """
import sys
from pathlib import Path
from autotune.config import TrainConfig
from autotune.probe.launcher import SubprocessSpawner, launch_probe
from autotune.probe.forkserver import ForkServer
from autotune.probe.spec import ProbeSpec
spawner = ForkServer() if sys.argv[2] == "forkserver" else SubprocessSpawner()
spec = ProbeSpec(model="tiny", config=TrainConfig(engine="ddp"), micro_batch_sizes=(1,),
                 seq_len=32, num_processes=2, device="cpu", timeout_s=600.0)
launch_probe(spec, Path(sys.argv[1]), spawner=spawner)
"""


@pytest.mark.parametrize("spawner", ["subprocess", "forkserver"])
def test_ranks_die_with_a_killed_tuner(tmp_path: Path, spawner: str) -> None:
    probe_dir = tmp_path / "probe"
    env = {**os.environ, "AUTOTUNE_TEST_FAULT": "hang"}  # every rank hangs after its build
    tuner = subprocess.Popen(
        [sys.executable, "-c", TUNER, str(probe_dir), spawner],
        env=env,
        start_new_session=True,
        cwd=Path(__file__).parents[2],
    )
    descendants: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(list(probe_dir.glob("rank*.json"))) < 2:  # both ranks built, now hanging
            assert tuner.poll() is None, "the tuner ended before its ranks started"
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.2)
        descendants += psutil.Process(tuner.pid).children(recursive=True)
        assert len(descendants) >= 2
        os.kill(tuner.pid, signal.SIGKILL)  # no chance to stop its probe
        tuner.wait()
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, f"processes outlived their tuner: {alive}"
    finally:
        if tuner.poll() is None:
            descendants += psutil.Process(tuner.pid).children(recursive=True)
            tuner.kill()
            tuner.wait()
        for proc in descendants:  # whatever is left, so that a failure leaves nothing behind
            if proc.is_running():
                proc.kill()
