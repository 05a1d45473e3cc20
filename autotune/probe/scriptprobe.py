"""A probe of the user's own training job: its script run once per micro-batch size.

Each size is a run of the job in a folder of its own (``mb<N>/`` under the probe's folder),
started by the launcher like any probe (one process group, the timeout, each rank's exit),
with the framework's adapter's command (:func:`autotune.handoff.script.job_command`) in place
of autotune's worker, and the measurement layer on the ranks' ``PYTHONPATH``
(:mod:`autotune.probe.userjob`). The sizes run in the order given; after any failure the
larger ones are not tried (memory only grows with the micro-batch), so the probe's result reads
as one of autotune's own worker. Ranks fork from the warm worker process where autotune's
launcher starts them (the script then runs as ``__main__`` of the fork, as ``python script.py``
would run it), and are fresh interpreters under a framework's own launcher (``accelerate
launch``) or without warm workers.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import autotune
from autotune.handoff.launch import Launch, one_line
from autotune.handoff.script import JobCommand, job_command, placed, shell_text, write_files
from autotune.models import resolve_model
from autotune.probe.forkserver import ForkServer
from autotune.probe.launcher import ProcessHandle, launch_probe, write_result
from autotune.probe.lifetime import PARENT_ENV
from autotune.probe.outcome import Outcome, Stage
from autotune.probe.result import ProbeResult, SizeResult
from autotune.probe.spec import ProbeSpec
from autotune.probe.userjob import PROBE_DIR_ENV
from autotune.tuned.script import ScriptJob

__all__ = [
    "MEASURE_DIR",
    "MeasuredRun",
    "ScriptSpawner",
    "launch_script_probe",
    "measured_environment",
    "run_measured",
]

MEASURE_DIR = Path(__file__).parent / "measure"
"""The folder whose ``sitecustomize`` turns the measurement layer on in a job's ranks."""

SPARE_STEPS = 1
"""Optimizer steps a probe lets the script plan beyond its warm-up and timed steps: the layer
stops the rank when the step after the last timed one begins."""

LOG_LINES = 3
"""Last lines of the job's output a failed probe's message quotes."""


def measured_environment(probe_dir: Path, base: dict[str, str]) -> dict[str, str]:
    """``base`` with the measurement layer on for the job run in ``probe_dir``."""
    package_root = str(Path(autotune.__file__).resolve().parent.parent)
    path = [str(MEASURE_DIR), package_root]
    if base.get("PYTHONPATH"):
        path.append(base["PYTHONPATH"])
    return {**base, PROBE_DIR_ENV: str(probe_dir), "PYTHONPATH": os.pathsep.join(path)}


@dataclass(frozen=True, slots=True)
class MeasuredRun:
    """A run of the job outside autotune (an exported command, as its user runs it) with the
    measurement layer on."""

    returncode: int
    stderr: str
    reports: list[dict[str, Any] | None]
    """Each rank's report (what a probe's rank writes), None where a rank wrote none."""


def run_measured(
    command: Sequence[str],
    spec: ProbeSpec,
    folder: Path,
    *,
    env: Mapping[str, str],
    timeout_s: float,
) -> MeasuredRun:
    """Run ``command`` in ``folder`` with the measurement layer checking it against ``spec``
    (its micro-batch, accumulation, checkpointing and engine) and reading each rank's steps
    and peak, as in a probe; ``env`` is the environment the command would have without the
    layer. The layer's files go to ``folder/measured``."""
    measured = folder / "measured"
    measured.mkdir(parents=True)
    (measured / "config.json").write_text(json.dumps(spec.to_dict()))
    done = subprocess.run(
        list(command),
        cwd=folder,
        env=measured_environment(measured, dict(env)),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    paths = [measured / f"rank{rank}.json" for rank in range(spec.world_size)]
    reports = [json.loads(path.read_text()) if path.is_file() else None for path in paths]
    return MeasuredRun(returncode=done.returncode, stderr=done.stderr, reports=reports)


def _transformers() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


def size_launch(spec: ProbeSpec, micro_batch_size: int) -> Launch:
    """The configuration of one run of the job, as a trainer's own."""
    model = resolve_model(spec.model)
    return Launch(
        model=spec.model,
        hidden_size=model.hidden_size,
        config=spec.config,
        micro_batch_size=micro_batch_size,
        grad_accum=spec.grad_accum,
        world_size=spec.world_size,
        nodes=spec.nodes,
        seq_len=spec.seq_len,
        transformers=_transformers(),
    )


_LAUNCHER_MODULES = {("accelerate", "launch"): "accelerate.commands.launch"}
"""A framework's launcher command, run as a module of this interpreter in a probe."""

_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""torchrun's variables, which a framework's own launcher sets for its ranks itself."""


class _Peer:
    """A rank that the framework's own launcher started: its exit is the launcher's."""

    def __init__(self, leader: subprocess.Popen[bytes]) -> None:
        self.leader = leader
        self.pid = leader.pid

    @property
    def returncode(self) -> int | None:
        return self.leader.returncode

    @returncode.setter
    def returncode(self, value: int | None) -> None:
        self.leader.returncode = value

    def poll(self) -> int | None:
        return self.leader.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.leader.wait(timeout)


class ScriptSpawner:
    """Each rank a fresh interpreter running the job's script with its configuration; or,
    where the framework has its own launcher (``accelerate launch``), that launcher once per
    node, which starts the node's ranks (each rank's exit is then the launcher's: a rank the
    kernel killed shows as the launcher's failure, not as SIGKILL)."""

    def __init__(self, command: JobCommand, warm: ForkServer | None = None) -> None:
        self.command = command
        self.warm = None if command.launcher else warm
        """The warm worker process ranks fork from (never under a framework's launcher)."""
        self.kind = "fresh" if self.warm is None else "warm"
        self._leader: subprocess.Popen[bytes] | None = None

    def _argv(self, env: dict[str, str]) -> list[str]:
        launcher = self.command.launcher
        if not launcher:
            return [sys.executable, *self.command.target]
        module = _LAUNCHER_MODULES[(launcher[0], launcher[1])]
        port = ["--main_process_port", env["MASTER_PORT"]] if "MASTER_PORT" in env else []
        return [sys.executable, "-m", module, *launcher[2:], *port, *self.command.target]

    def spawn(
        self, probe_dir: Path, env: dict[str, str], stdout: Path, stderr: Path, process_group: int
    ) -> ProcessHandle:
        if self._leader is not None:
            return _Peer(self._leader)
        if self.warm is not None:
            ranks = measured_environment(probe_dir, {**env, **self.command.env})
            return self.warm.spawn(
                probe_dir, ranks, stdout, stderr, process_group, script=self.command.target
            )
        argv = self._argv(env)
        if self.command.launcher:
            env = {k: v for k, v in env.items() if k not in _RANK_VARIABLES}
        ranks = measured_environment(probe_dir, {**env, **self.command.env})
        with stdout.open("ab") as out, stderr.open("ab") as err:
            proc = subprocess.Popen(
                argv,
                env={**ranks, PARENT_ENV: str(os.getpid())},
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                process_group=process_group,
            )
        if self.command.launcher:
            self._leader = proc
        return proc


def _log_tail(folder: Path) -> str:
    """The job's last lines of output, for the message of a probe that failed."""
    lines: list[str] = []
    for name in ("stdout.log", "stderr.log"):
        try:
            text = (folder / name).read_text(errors="replace")
        except OSError:
            continue
        lines += [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[-LOG_LINES:])


def _write_command(folder: Path, run: JobCommand, launch: Launch) -> None:
    """cmd.txt: this run of the job by hand, as the launcher ran it (the launcher's own
    lines name its worker, which a job's probe does not run)."""
    script = shell_text(run, launch, launch.summary(), with_files=False)
    text = script.removesuffix("\n").split("\n")  # the shell's lines (a path may hold "\r")
    layer = measured_environment(folder, {})
    lines = [
        "# Rerun this run of the job by hand (from the directory autotune ran in):",
        f"cd {shlex.quote(os.getcwd())}",
        *text[1:],
        "",
        "# measured with the layer on: "
        + one_line(" ".join(f"{k}={shlex.quote(v)}" for k, v in layer.items())),
    ]
    (folder / "cmd.txt").write_text("\n".join(lines) + "\n")


def _hung_before_training(result: ProbeResult, spec: ProbeSpec) -> None:
    """A run stopped at its bound before the job's first training step (the layer marks that
    step in the report, ``build_s``): said as a hang before training, and the outcome of the
    size it ran, so its trial reads ``timeout`` (the message, with the job's last lines, is
    the run's)."""
    result.stage = Stage.STARTUP
    result.message = (
        f"the job did not reach its first training step within the probe's bound of "
        f"{spec.timeout_s:.0f} s: check what it waits for before it trains (a lock, a "
        "download, another rank)"
    )
    result.sizes = [
        SizeResult(
            micro_batch_size=spec.micro_batch_sizes[0], outcome=Outcome.TIMEOUT, stage=Stage.STARTUP
        )
    ]
    write_result(result)


def _run_size(
    spec: ProbeSpec,
    job: ScriptJob,
    micro_batch_size: int,
    folder: Path,
    on_poll: Callable[[float], None] | None,
    warm: ForkServer | None,
) -> ProbeResult:
    one = dataclasses.replace(
        spec, micro_batch_sizes=(micro_batch_size,), grad_accum=spec.accumulation(micro_batch_size)
    )
    launch = size_launch(one, micro_batch_size)
    steps = spec.warmup_steps + spec.timed_steps + SPARE_STEPS
    command = job_command(job, launch, max_steps=steps, cpu=spec.device == "cpu")
    folder.mkdir(parents=True, exist_ok=True)
    write_files(command, folder)
    run = placed(command, folder)
    result = launch_probe(one, folder, spawner=ScriptSpawner(run, warm), on_poll=on_poll)
    if result.outcome is Outcome.TIMEOUT and result.build_s is None:
        _hung_before_training(result, one)
    # cmd.txt holds no secret of the job's arguments: the user sets them as variables.
    shown = job_command(job.for_shell(), launch, max_steps=steps, cpu=spec.device == "cpu")
    _write_command(folder, placed(shown, folder), launch)
    if result.outcome not in (Outcome.OK, Outcome.OOM):
        tail = _log_tail(folder)
        if tail and tail not in result.message:
            result.message = f"{result.message}; the job's last lines: {tail}"
        said = result.message
        result.message = job.redact(said)  # a job's error may quote its arguments
        if result.message != said and (folder / "result.json").is_file():
            write_result(result)
    return result


def launch_script_probe(
    spec: ProbeSpec,
    probe_dir: Path,
    *,
    on_poll: Callable[[float], None] | None = None,
    warm: ForkServer | None = None,
) -> ProbeResult:
    """Run the user's job at each of ``spec``'s sizes and merge the runs into one result
    (``result.json`` in ``probe_dir``); ``warm``: fork the ranks from that warm worker
    process, where the framework's own launcher does not start them.

    Raises:
        ForkServerError: The warm process could not fork a rank (the caller runs the probe
            again with fresh interpreters).
    """
    assert spec.script is not None
    job = spec.script
    probe_dir.mkdir(parents=True, exist_ok=True)
    runs: list[ProbeResult] = []
    spent = 0.0
    for mbs in spec.micro_batch_sizes:

        def poll(elapsed: float, before: float = spent) -> None:
            if on_poll is not None:
                on_poll(before + elapsed)

        left = dataclasses.replace(spec, timeout_s=max(1.0, spec.timeout_s - spent))
        result = _run_size(left, job, mbs, probe_dir / f"mb{mbs}", poll, warm)
        runs.append(result)
        spent += result.wall_s
        if result.outcome is not Outcome.OK or result.tuner_fault:
            break
    last = runs[-1]
    first = runs[0]
    merged = ProbeResult(
        spec=spec,
        probe_dir=probe_dir,
        outcome=last.outcome,
        stage=last.stage,
        message=last.message,
        failed_rank=last.failed_rank,
        sizes=[size for run in runs for size in run.sizes],
        wall_s=spent,
        import_s=first.import_s,
        startup_s=first.startup_s,
        spawn=first.spawn,
        build_s=first.build_s,
        device=first.device,
        gpu_name=first.gpu_name,
        peak_flops=first.peak_flops,
        num_params=first.num_params,
        exits=last.exits,
        tuner_fault=last.tuner_fault,
    )
    write_result(merged)
    return merged
