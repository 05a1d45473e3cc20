"""A tuner killed outright leaves no probe behind: its ranks (and fork server) die with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import kill_tuner_once_ranks_run

TUNER = """
import sys
from pathlib import Path
from autotune.config import TrainConfig
from autotune.probe import faults
faults.arm()  # the test suite's tuner: its AUTOTUNE_TEST_FAULT reaches the ranks
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
    kill_tuner_once_ranks_run(tuner, probe_dir, ranks=2, processes=2)
