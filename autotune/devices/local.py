"""Real probes on this node: ranks started by the launcher, on its GPUs or its CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from autotune.devices.base import Clock, SetupResult, SetupStep, WallClock
from autotune.probe.launcher import Spawner, launch_probe
from autotune.probe.lifetime import PARENT_ENV
from autotune.probe.ops import (
    BUILD_WAIT_S,
    build_command,
    deepspeed_ops,
    extensions_dir,
    library_path,
    op_environment,
    torch_lock_path,
)
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec

__all__ = ["LocalDevice"]


class LocalDevice:
    """This node's GPUs (``cuda``) or its CPU (``cpu``, usually under an emulated device cap).

    Before a DeepSpeed probe, :meth:`setup` offers to build the ops it will load that are not
    built yet (``python -m autotune.probe.ops build``), so no probe spends its time, or its
    timeout, compiling them.

    Args:
        kind: ``cuda`` or ``cpu``.
        spawner: How ranks start: fresh interpreters (the default) or forks of a
            :class:`~autotune.probe.forkserver.ForkServer` that has imported torch already.
        build_wait_s: How long the set-up step waits for another process's build of the
            same ops before giving up.
    """

    def __init__(
        self, kind: str, *, spawner: Spawner | None = None, build_wait_s: float = BUILD_WAIT_S
    ) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"unknown local device {kind!r}: use cuda or cpu")
        self.kind = kind
        self.spawner = spawner
        self.build_wait_s = build_wait_s
        self._ready: set[str] = set()
        """Ops a set-up step of this device settled (built, or not used by DeepSpeed here)."""
        self._failed: set[str] = set()
        """Ops whose build failed: not tried again (probes then build, or fail, themselves)."""

    def setup(self, spec: ProbeSpec) -> SetupStep | None:
        """Building the DeepSpeed ops ``spec`` loads that are not built, or whose torch build
        lock was left by a killed probe; None when there are none (a look at a few files)."""
        env = op_environment(os.environ)
        directory = extensions_dir(env)
        todo = [
            op
            for op in deepspeed_ops(spec.config, self.kind)
            if op not in self._failed
            and (
                torch_lock_path(directory, op).exists()
                or (op not in self._ready and not library_path(directory, op).is_file())
            )
        ]
        if not todo:
            return None
        label = f"building DeepSpeed ops: {', '.join(todo)}"
        return SetupStep(label=label, run=lambda: self._build(label, todo, env))

    def _build(self, label: str, ops: list[str], env: dict[str, str]) -> SetupResult:
        """Run the build step in a process of its own (own process group: a Ctrl-C is the
        tuner's, which stops it), its output in a log kept only if it fails."""
        directory = extensions_dir(env)
        directory.mkdir(parents=True, exist_ok=True)
        log = directory / f"autotune-build-{os.getpid()}.log"
        started = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.Popen(
                build_command(ops, directory, wait_s=self.build_wait_s),
                env={**env, PARENT_ENV: str(os.getpid())},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                process_group=0,
            )
            try:
                code = proc.wait()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # its compiler jobs too
                proc.wait()
                raise
        seconds = time.monotonic() - started
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        warnings = tuple(line for line in lines if line.startswith("warning:"))
        last = lines[-1] if lines else "(no output)"
        if code == 0:
            self._ready.update(ops)
            log.unlink()
            return SetupResult(
                label=label, ok=True, seconds=seconds, message=last, warnings=warnings
            )
        self._failed.update(ops)
        return SetupResult(
            label=label,
            ok=False,
            seconds=seconds,
            message=f"{last} (exit {code}; output in {log})",
            warnings=warnings,
        )

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
