"""Real probes on this node: ranks started by the launcher, on its GPUs or its CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autotune.devices.base import Clock, WallClock
from autotune.probe.launcher import Spawner, launch_probe
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

__all__ = ["LocalDevice"]


class LocalDevice:
    """This node's GPUs (``cuda``) or its CPU (``cpu``, usually under an emulated device cap).

    Args:
        kind: ``cuda`` or ``cpu``.
        spawner: How ranks start: fresh interpreters (the default) or forks of a
            :class:`~autotune.probe.forkserver.ForkServer` that has imported torch already.
    """

    def __init__(self, kind: str, *, spawner: Spawner | None = None) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"unknown local device {kind!r}: use cuda or cpu")
        self.kind = kind
        self.spawner = spawner

    def launch(
        self,
        spec: ProbeSpec,
        probe_dir: Path,
        *,
        on_poll: Callable[[float], None] | None = None,
    ) -> ProbeResult:
        return launch_probe(spec, probe_dir, spawner=self.spawner, on_poll=on_poll)

    def clock(self) -> Clock:
        return WallClock()

    def __repr__(self) -> str:
        return f"LocalDevice({self.kind!r})"
