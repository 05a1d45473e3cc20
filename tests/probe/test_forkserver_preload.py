"""The fork server's preloading: what it imports once, and what a rank forked from it imports
itself. Its faults and restarts, which race probes' clocks, are tests/probe/test_warm.py's."""

from __future__ import annotations

from pathlib import Path

from autotune.config import TrainConfig
from autotune.probe.forkserver import ForkServer
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
