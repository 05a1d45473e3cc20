"""The fork server's preloading: what it imports once, and what a rank forked from it imports
itself. Its faults and restarts, which race probes' clocks, are tests/probe/test_warm.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from autotune.config import TrainConfig
from autotune.probe.forkserver import DEEPSPEED_OPTIMIZER_CHECK, ForkServer
from autotune.probe.launcher import launch_probe
from autotune.probe.outcome import Outcome
from autotune.probe.spec import ProbeSpec
from tests.conftest import PROBE_DEFAULTS


def test_a_server_without_the_model_modules_forks_ranks_that_import_their_own(
    tmp_path: Path,
) -> None:
    """Where importing transformers' model modules initializes CUDA (torchao installed on a
    GPU host) the server starts again without them: a rank forked from that server imports
    its model's module itself and measures what a rank of the full server measures."""
    spec = ProbeSpec(**PROBE_DEFAULTS, config=TrainConfig(engine="single"))
    with ForkServer(preload_models=False) as server:
        assert not server.models and not server.deepspeed
        bare = launch_probe(spec, tmp_path / "bare", spawner=server)
    with ForkServer() as server:
        assert server.models
        full = launch_probe(spec, tmp_path / "full", spawner=server)
    for result in (bare, full):
        assert result.outcome is Outcome.OK, result.message
        assert result.spawn == "warm"
    assert [s.losses for s in bare.sizes] == [s.losses for s in full.sizes]


def test_the_server_preloads_what_deepspeeds_optimizer_check_imports() -> None:
    """deepspeed.initialize checks the optimizer in every engine, and that check imports a
    module whose import builds torch.compile's machinery (about 2 s a rank here): the full
    server has it loaded, so a forked DeepSpeed rank does not import it again. The module is
    the one this DeepSpeed's check really names."""
    from deepspeed.runtime.zero.utils import is_zero_supported_optimizer

    assert DEEPSPEED_OPTIMIZER_CHECK in is_zero_supported_optimizer.__code__.co_names
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from autotune.probe import forkserver; forkserver._preload('always'); "
            "print(forkserver.DEEPSPEED_OPTIMIZER_CHECK in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    # DeepSpeed logs to stdout too: the answer is the last line.
    assert loaded.stdout.splitlines()[-1] == "True", loaded.stdout[-2000:]
