"""The probe process: one rank of a probe, run as ``python -m autotune.probe.worker DIR``.

It reads ``DIR/config.json``, builds the model with the engine, runs warm-up and timed steps
at each micro-batch size, and writes ``DIR/rank<N>.json`` after every size, so a crash keeps
what was measured before it. It knows nothing of the search or of Optuna. The rank layout
comes from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so ``torchrun -m autotune.probe.worker DIR`` runs it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist

from autotune.config import TrainConfig
from autotune.hardware import peak_flops_for
from autotune.models import ModelSpec, resolve_model
from autotune.probe.data import synthetic_batch
from autotune.probe.engines import EngineContext, Trainee, build_trainee, load_engine
from autotune.probe.faults import FAULT_ENV, fault_for, read_request
from autotune.probe.lifetime import PARENT_ENV, die_with_parent
from autotune.probe.memory import LiveTensorBytes, MemoryMeter, apply_cuda_limit
from autotune.probe.metrics import now, probe_throughput, synchronize
from autotune.probe.outcome import Outcome, Stage, is_oom_error
from autotune.probe.report import RankReport
from autotune.probe.spec import ProbeSpec
from autotune.space import oom_rules_out

if TYPE_CHECKING:
    from autotune.probe.rlhf import Iteration


@dataclass(kw_only=True, slots=True)
class _Rank:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


@dataclass(kw_only=True, slots=True)
class _Failure:
    outcome: Outcome
    stage: Stage
    message: str
    error_type: str


FLOOD_BYTES = 100 << 20
STRAY_MARK = "autotune-test-stray"
"""On the command line of the child the ``stray`` fault starts."""
_fault_dir = ""
_fault_request = ""
"""This probe's test fault request (:mod:`autotune.probe.faults`), read from its folder."""


def _fault(rank: int, config: TrainConfig) -> str | None:
    """The fault the probe's test fault request asks of this rank, if any."""
    return fault_for(_fault_request, rank, config.engine.value, config.label())


def _flood() -> None:
    chunk = b"flood " * ((1 << 20) // 6) + b"\n"
    for fd in (1, 2):
        os.write(fd, b"flood begins\n")
        written = 0
        while written < FLOOD_BYTES:
            written += os.write(fd, chunk)
        os.write(fd, b"flood ends\n")


def _inject_fault(rank: int, config: TrainConfig) -> None:
    kind = _fault(rank, config)
    if kind == "segfault":
        ctypes.string_at(0)  # a real SIGSEGV
    elif kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
    elif kind == "hang":
        time.sleep(10**6)
    elif kind == "error":
        raise RuntimeError(f"injected failure ({FAULT_ENV})")
    elif kind == "flood":
        _flood()
    elif kind == "stray":
        # What ninja does with each compiler: a child in a process group of its own.
        stray = [sys.executable, "-c", "import time; time.sleep(600)", STRAY_MARK, _fault_dir]
        subprocess.Popen(stray, process_group=0, stdin=subprocess.DEVNULL)
        time.sleep(10**6)


def _spoil_report(path: Path, rank: int, config: TrainConfig) -> None:
    """The report faults of a test fault request: what a torn write, a full disk or another
    process would leave of the report."""
    kind = _fault(rank, config)
    if kind == "garble":
        text = path.read_text()
        path.write_text(text[: len(text) // 2])
    elif kind == "empty":
        path.write_text("")
    elif kind == "noreport":
        path.unlink()


def _place_rank(spec: ProbeSpec, rank: int, world_size: int) -> _Rank:
    """Pick this rank's device (LOCAL_RANK-th GPU, or the CPU)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_type = spec.device
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda, but no GPU is visible to this process")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return _Rank(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def _failure(error: BaseException, stage: Stage) -> _Failure:
    oom = is_oom_error(error)
    return _Failure(
        outcome=Outcome.OOM if oom else Outcome.ERROR,
        stage=stage,
        message=f"{type(error).__name__}: {error}".splitlines()[0][:500],
        error_type=type(error).__name__,
    )


def _fail(report: RankReport, failure: _Failure) -> None:
    report.fail(failure.outcome, failure.stage, failure.message, failure.error_type)


def _peak_flops(spec: ProbeSpec, device: torch.device) -> tuple[float | None, str | None]:
    if device.type != "cuda":
        return None, None
    name = torch.cuda.get_device_name(device)
    return peak_flops_for(name, spec.config.precision.compute_dtype), name


class _StepLoop:
    """Warm-up and timed steps at one micro-batch size; ``stage`` says where it is."""

    def __init__(self, spec: ProbeSpec, model: ModelSpec, rank: _Rank, trainee: Trainee) -> None:
        self.spec = spec
        self.model = model
        self.rank = rank
        self.trainee = trainee
        self.stage = Stage.BUILD

    def run(self, micro_batch_size: int, meter: MemoryMeter) -> dict[str, Any]:
        spec, device = self.spec, self.rank.device
        batch = synthetic_batch(
            self.model,
            micro_batch_size,
            spec.seq_len,
            # The ranks of a TP group train on the same sequences: the data-parallel rank's.
            seed=spec.seed + self.rank.rank // spec.config.model_parallel,
            device=str(device),
        )
        accumulation = spec.accumulation(micro_batch_size)
        meter.reset()
        self.stage = Stage.FORWARD
        _inject_fault(self.rank.rank, spec.config)
        micro_times: list[float] = []
        optimizer_times: list[float] = []
        losses: list[float] = []
        step_times: list[float] = []  # back to back: they sum to the timed window
        start = window_start = mark = now()
        for step in range(spec.warmup_steps + spec.timed_steps):
            timed = step >= spec.warmup_steps
            if step == spec.warmup_steps:
                synchronize(device)
                window_start = mark = now()
            loss = None
            pipelined = self.trainee.pipelined
            if pipelined:
                # A pipeline runs the step's micro-batches in one schedule: each counts an
                # equal share of its time (the bubble included).
                synchronize(device)
                began = now()
                self.stage = Stage.FORWARD
                loss = self.trainee.pipeline_step(batch, accumulation)
                synchronize(device)
                if timed:
                    micro_times += [(now() - began) / accumulation] * accumulation
            for micro in range(0 if pipelined else accumulation):
                sync = micro == accumulation - 1
                synchronize(device)
                began = now()
                self.stage = Stage.FORWARD
                loss = self.trainee.forward(batch, sync=sync)
                self.stage = Stage.BACKWARD
                self.trainee.backward(loss, sync=sync)
                synchronize(device)
                if timed:
                    micro_times.append(now() - began)
            self.stage = Stage.OPTIMIZER
            began = now()
            self.trainee.optimizer_step()
            synchronize(device)
            if timed:
                optimizer_times.append(now() - began)
            assert loss is not None
            losses.append(float(loss.detach().float().item()))
            if timed:
                ended = now()
                step_times.append(ended - mark)
                mark = ended
        end = mark if step_times else now()
        return {
            "losses": losses,
            "micro_times": micro_times,
            "optimizer_times": optimizer_times,
            "step_times": step_times,
            "warmup_s": window_start - start,
            "timed_s": end - window_start,
        }


class _IterationLoop:
    """An RL iteration's warm-up and timed steps at one micro-batch size
    (:mod:`autotune.probe.rlhf`); ``stage`` says where it is."""

    def __init__(
        self, spec: ProbeSpec, model: ModelSpec, rank: _Rank, iteration: Iteration
    ) -> None:
        self.spec = spec
        self.model = model
        self.rank = rank
        self.iteration = iteration

    @property
    def stage(self) -> Stage:
        return self.iteration.stage

    def run(self, micro_batch_size: int, meter: MemoryMeter) -> dict[str, Any]:
        spec = self.spec
        batches = [
            synthetic_batch(
                self.model,
                micro_batch_size,
                spec.seq_len,
                seed=spec.seed + self.rank.rank + 1000 * micro,
                device=str(self.rank.device),
            )
            for micro in range(spec.grad_accum)
        ]
        _inject_fault(self.rank.rank, spec.config)
        return self.iteration.run(batches, spec.timed_steps, spec.warmup_steps, meter)


def _size_result(
    spec: ProbeSpec,
    model: ModelSpec,
    mbs: int,
    raw: dict[str, Any],
    peak_flops: float | None,
) -> dict[str, Any]:
    losses = raw["losses"]
    speed = probe_throughput(
        spec,
        model,
        mbs,
        micro_step_s=statistics.median(raw["micro_times"]),
        optimizer_step_s=statistics.median(raw["optimizer_times"]),
        peak_flops=peak_flops,
    )
    finite = all(map(math.isfinite, losses))
    result: dict[str, Any] = {
        "micro_batch_size": mbs,
        "outcome": Outcome.OK.value,
        "losses": losses,
        "loss_finite": finite,
        "warmup_s": raw["warmup_s"],
        "timed_s": raw["timed_s"],
        "step_times": raw["step_times"],
        **speed.to_dict(),
    }
    if not finite:
        result.update(outcome=Outcome.ERROR.value, message="loss is not finite")
    return result


def _free_after_failure(trainee: Trainee | None, device: torch.device) -> None:
    """Release what a failed step held (called outside the except block, so no frame pins it)."""
    if trainee is not None:
        trainee.discard_gradients()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass(kw_only=True, slots=True)
class _Probe:
    """What the start step sets up: the spec, this rank's place, its report and memory meter."""

    spec: ProbeSpec
    rank: _Rank
    report: RankReport
    meter: MemoryMeter


@dataclass(kw_only=True, slots=True)
class _Built:
    """What the build step makes: the model's description and the engine's trainee."""

    model: ModelSpec
    trainee: Trainee
    peak_flops: float | None
    iteration: Iteration | None = None
    """An RL iteration's other models and engine reservation (``autotune.probe.rlhf``)."""


def _limit_memory(
    spec: ProbeSpec, rank: _Rank, stack: contextlib.ExitStack
) -> LiveTensorBytes | None:
    """Cap device memory: the CUDA allocator's fraction, or on the CPU a tensor byte counter
    entered on ``stack`` (it also gives the CPU's readings when there is no cap)."""
    if rank.device.type == "cuda":
        if spec.device_memory_bytes is not None:
            apply_cuda_limit(spec.device_memory_bytes, rank.device)
        return None
    tracker = stack.enter_context(LiveTensorBytes(spec.device_memory_bytes))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.world_size))
    return tracker


def _start(probe_dir: Path, stack: contextlib.ExitStack) -> _Probe | None:
    """Start-up: read the spec, place this rank, cap its memory, join the process group and
    load the engine's libraries (DeepSpeed and its ops); None when that failed (reported).

    Reports ``import_s`` (spawn to this code running: the interpreter and its imports, near
    zero for a rank forked from a warm process) and ``startup_s`` (spawn to ready to build
    the model: CUDA, the process group and the engine included)."""
    started = float(os.environ.get("AUTOTUNE_SPAWN_TIME") or psutil.Process().create_time())
    spec = ProbeSpec.from_dict(json.loads((probe_dir / "config.json").read_text()))
    rank_index = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    report = RankReport(probe_dir / f"rank{rank_index}.json", rank_index, world_size)
    report.update(import_s=time.time() - started)
    try:
        rank = _place_rank(spec, rank_index, world_size)
        report.update(device=str(rank.device))
        tracker = _limit_memory(spec, rank, stack)
        _join_process_group(spec, rank)
        load_engine(spec.config, rank.device.type)
    except Exception as error:
        report.update(traceback=traceback.format_exc())
        _fail(report, _failure(error, Stage.STARTUP))
        return None
    report.update(startup_s=time.time() - started)
    meter = MemoryMeter(
        device=rank.device, tracker=tracker, emulated_limit_bytes=spec.device_memory_bytes
    )
    return _Probe(spec=spec, rank=rank, report=report, meter=meter)


def _join_process_group(spec: ProbeSpec, rank: _Rank) -> None:
    """Join the ranks' process group (NCCL on GPUs, gloo on the CPU) if the engine needs one."""
    if not spec.config.is_distributed or dist.is_initialized():
        return
    cuda = rank.device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        timeout=timedelta(seconds=max(60.0, spec.timeout_s)),
        device_id=rank.device if cuda else None,
    )


def _engine_context(spec: ProbeSpec, model: ModelSpec, rank: _Rank) -> EngineContext:
    return EngineContext(
        model=model,
        config=spec.config,
        device=rank.device,
        rank=rank.rank,
        world_size=rank.world_size,
        micro_batch_size=spec.micro_batch_sizes[0],
        grad_accum=spec.accumulation(spec.micro_batch_sizes[0]),
        lr=spec.lr,
        seed=spec.seed,
    )


def _build(probe: _Probe) -> _Built | None:
    """Build the model and the engine; None when that failed (reported)."""
    spec, rank, report = probe.spec, probe.rank, probe.report
    try:
        model = resolve_model(spec.model)
        began = now()
        context = _engine_context(spec, model, rank)
        trainee = build_trainee(context)
        iteration = None
        if spec.rlhf is not None:
            from autotune.probe.rlhf import build_iteration

            iteration = build_iteration(context, spec.rlhf, trainee, spec.device_memory_bytes)
        synchronize(rank.device)
        peak_flops, gpu_name = _peak_flops(spec, rank.device)
        report.update(
            build_s=now() - began,
            build_memory=probe.meter.read(),
            gpu_name=gpu_name,
            peak_flops=peak_flops,
            num_params=model.num_params,
        )
        return _Built(model=model, trainee=trainee, peak_flops=peak_flops, iteration=iteration)
    except Exception as error:
        failure = _failure(error, Stage.BUILD)
        report.update(traceback=traceback.format_exc())
    _fail(report, failure)
    return None


def _record_size(probe: _Probe, built: _Built, mbs: int, raw: dict[str, Any]) -> None:
    """Add a measured micro-batch size to the report (and say it on rank 0)."""
    sizes: list[dict[str, Any]] = probe.report.data["sizes"]
    result = _size_result(probe.spec, built.model, mbs, raw, built.peak_flops)
    reading = probe.meter.read()
    if "rlhf" in raw:
        # The iteration read each phase's peak apart: the size's is the largest.
        phases = raw["rlhf"]
        result["rlhf"] = phases
        reading["peak_allocated_bytes"] = max(phases["phase_peak_bytes"].values())
        reading["peak_reserved_bytes"] = max(phases["phase_reserved_bytes"].values())
    sizes.append({**result, **reading})
    probe.report.write()
    if probe.rank.rank == 0:
        last = sizes[-1]
        print(
            f"micro-batch {mbs}: {last['tokens_per_second']:.1f} tokens/s, "
            f"loss {last['losses'][0]:.3f} -> {last['losses'][-1]:.3f}",
            flush=True,
        )


def _record_failure(probe: _Probe, built: _Built, mbs: int, failure: _Failure) -> None:
    """Free what the failed size held, then add it to the report as failed."""
    if built.iteration is not None:
        built.iteration.discard()
    _free_after_failure(built.trainee, probe.rank.device)
    probe.report.data["sizes"].append(
        {
            "micro_batch_size": mbs,
            "outcome": failure.outcome.value,
            "stage": failure.stage.value,
            "message": failure.message,
            **probe.meter.read(),
        }
    )
    _fail(probe.report, failure)


def _measure_size(
    probe: _Probe, built: _Built, loop: _StepLoop | _IterationLoop, mbs: int
) -> _Failure | None:
    """Measure one micro-batch size into the report; how it failed, or None."""
    try:
        raw = loop.run(mbs, probe.meter)
    except Exception as error:
        failure = _failure(error, loop.stage)
        probe.report.update(traceback=traceback.format_exc())
    else:
        _record_size(probe, built, mbs, raw)
        return None
    # Out of the except block: no traceback frame pins the failed step's memory any more.
    _record_failure(probe, built, mbs, failure)
    return failure


def _measure(probe: _Probe, built: _Built) -> int:
    """Measure each micro-batch size; on one rank an OOM skips the sizes it rules out
    (``space.oom_rules_out``: the larger ones that accumulate as it did)."""
    loop: _StepLoop | _IterationLoop = (
        _StepLoop(probe.spec, built.model, probe.rank, built.trainee)
        if built.iteration is None
        else _IterationLoop(probe.spec, built.model, probe.rank, built.iteration)
    )
    failed_size: int | None = None
    for mbs in probe.spec.micro_batch_sizes:
        if failed_size is not None and oom_rules_out(failed_size, mbs, probe.spec.accumulation):
            continue  # memory grows with the micro-batch: it cannot fit either
        failure = _measure_size(probe, built, loop, mbs)
        if failure is None:
            continue
        if failure.outcome is not Outcome.OOM or probe.rank.world_size > 1:
            return 1
        failed_size = mbs
    probe.report.finish()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def run(probe_dir: Path) -> int:
    """Run this rank's part of the probe in ``probe_dir``; returns the exit code."""
    global _fault_request, _fault_dir
    _fault_request, _fault_dir = read_request(probe_dir), str(probe_dir)
    gc.freeze()  # the imports' objects outlive the probe: no collection need walk them
    with contextlib.ExitStack() as stack:  # holds the CPU's tensor byte counter
        probe = _start(probe_dir, stack)
        if probe is None:
            return 1
        built = _build(probe)
        if built is None:
            return 1
        code = _measure(probe, built)
        _spoil_report(probe.report.path, probe.rank.rank, probe.spec.config)
        if code == 0 and _fault(probe.rank.rank, probe.spec.config) == "linger":
            time.sleep(10**6)  # finished, but never exits (a teardown that hangs)
        return code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m autotune.probe.worker PROBE_DIR", file=sys.stderr)
        return 2
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent else None)  # no orphan rank outlives its tuner
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())
