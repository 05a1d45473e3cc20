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
from autotune.probe.forkserver import ForkServer, ForkServerError, WarmWorkers
from autotune.probe.launcher import Spawner, SubprocessSpawner, launch_probe
from autotune.probe.lifetime import PARENT_ENV, descendants, kill_all
from autotune.probe.nodes import Nodes
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
from autotune.probe.scriptprobe import launch_script_probe
from autotune.probe.spec import ProbeSpec
from autotune.tuned.script import Framework

__all__ = ["LocalDevice"]


def _own_launcher(spec: ProbeSpec) -> bool:
    """Whether a framework's own launcher starts the probe's ranks (``accelerate launch``)."""
    return spec.script is not None and spec.script.framework is Framework.ACCELERATE


class LocalDevice:
    """This node's GPUs (``cuda``) or its CPU (``cpu``, usually under an emulated device cap).

    Before a probe, :meth:`setup` offers the steps it needs first, each outside any probe's
    timeout: building the DeepSpeed ops it will load that are not built yet (``python -m
    autotune.probe.ops build``), and starting (or restarting, when stale) the warm process its
    ranks fork from (:class:`~autotune.probe.forkserver.WarmWorkers`). A probe whose ranks
    cannot be forked runs again at once as fresh interpreters, and so does the rest of the run.

    Args:
        kind: ``cuda`` or ``cpu``.
        spawner: How ranks start, if not by this device's own warm workers: fresh interpreters
            (:class:`~autotune.probe.launcher.SubprocessSpawner`) or a shared
            :class:`~autotune.probe.forkserver.ForkServer`.
        warm: Fork ranks from warm workers (when no ``spawner`` is given); off: every rank
            is a fresh interpreter.
        build_wait_s: How long the set-up step waits for another process's build of the
            same ops before giving up.
        nodes: The hosts a probe over several nodes runs on (``spec.nodes``), and how its
            node agents reach them (:mod:`autotune.probe.nodes`); their ranks start as fresh
            interpreters. None: every probe runs on this node.
    """

    def __init__(
        self,
        kind: str,
        *,
        spawner: Spawner | None = None,
        warm: bool = True,
        build_wait_s: float = BUILD_WAIT_S,
        nodes: Nodes | None = None,
    ) -> None:
        if kind not in ("cuda", "cpu"):
            raise ValueError(f"unknown local device {kind!r}: use cuda or cpu")
        self.kind = kind
        self.spawner = spawner
        self.warm = WarmWorkers() if spawner is None and warm else None
        """The warm process ranks fork from (None: ``spawner``, or fresh interpreters)."""
        self.build_wait_s = build_wait_s
        self.nodes = nodes
        self._ready: set[str] = set()
        """Ops a set-up step of this device settled (built, or not used by DeepSpeed here)."""
        self._failed: set[str] = set()
        """Ops whose build failed: not tried again (probes then build, or fail, themselves)."""

    def setup(self, spec: ProbeSpec) -> list[SetupStep]:
        """The steps before ``spec`` can be probed: building the DeepSpeed ops it loads that
        are not built (or whose torch build lock a killed probe left), and starting the warm
        workers (or restarting stale ones). A look at a few files, and one question to the
        warm process."""
        steps = []
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
        if todo:
            label = f"building DeepSpeed ops: {', '.join(todo)}"
            steps.append(SetupStep(label=label, run=lambda: self._build(label, todo, env)))
        # Agents start fresh interpreters, and so does a framework's own launcher.
        warm = self.warm if spec.nodes == 1 and not _own_launcher(spec) else None
        pending = warm.pending() if warm is not None else None
        if warm is not None and pending is not None:
            steps.append(SetupStep(label=pending, run=lambda: self._start_warm(warm, pending)))
        return steps

    @staticmethod
    def _start_warm(warm: WarmWorkers, label: str) -> SetupResult:
        started = time.monotonic()
        message = warm.start()
        return SetupResult(
            label=label,
            ok=warm.off is None,
            seconds=time.monotonic() - started,
            message=message,
        )

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
                compilers = descendants([proc.pid])  # ninja's: process groups of their own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                kill_all(compilers)
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
        if spec.script is not None:
            return self._launch_script(spec, probe_dir, on_poll)
        if spec.nodes > 1:
            return launch_probe(spec, probe_dir, nodes=self.nodes, on_poll=on_poll)
        if self.spawner is not None or self.warm is None:
            return launch_probe(spec, probe_dir, spawner=self.spawner, on_poll=on_poll)
        try:
            return launch_probe(spec, probe_dir, spawner=self.warm.spawner, on_poll=on_poll)
        except ForkServerError as error:
            self.warm.give_up(str(error))
        note = f"autotune: {self.warm.off}; the ranks start again as fresh interpreters\n"
        with (probe_dir / "stderr.log").open("a") as log:
            log.write(note)
        return launch_probe(spec, probe_dir, spawner=SubprocessSpawner(), on_poll=on_poll)

    def _launch_script(
        self, spec: ProbeSpec, probe_dir: Path, on_poll: Callable[[float], None] | None
    ) -> ProbeResult:
        """A probe of the user's own script: its ranks forked from the warm workers where
        they can be, else (and after a fork that failed) fresh interpreters."""
        server = None
        if self.warm is not None and not _own_launcher(spec):
            spawner = self.warm.spawner
            server = spawner if isinstance(spawner, ForkServer) else None
        try:
            return launch_script_probe(spec, probe_dir, on_poll=on_poll, warm=server)
        except ForkServerError as error:
            assert self.warm is not None
            self.warm.give_up(str(error))
        return launch_script_probe(spec, probe_dir, on_poll=on_poll)

    def close(self) -> None:
        """Stop the warm workers, if they run (the next :meth:`setup` starts them again)."""
        if self.warm is not None:
            self.warm.close()

    def clock(self) -> Clock:
        return WallClock()

    def __repr__(self) -> str:
        where = "" if self.nodes is None else f", nodes={self.nodes.hosts!r}"
        return f"LocalDevice({self.kind!r}{where})"
