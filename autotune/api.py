"""autotune as a library: what the command line, the tests and the benchmarks call.

- :func:`tune` (or :func:`prepare` and :meth:`Tuning.run`): search for the fastest
  configuration that fits, recording every probe in the study;
- :func:`plan`: every configuration ranked by the estimator, without a GPU;
- :func:`best` and :func:`trials`: read a trial database back;
- :func:`export`: the best configuration (or a trial's) as a trainer's own configuration;
- :func:`write_report`: a study as one self-contained HTML page of charts and tables;
- :func:`probe`: run one configuration for real.

Sizes and durations take units as text (``"20GiB"``, ``"1h30m"``) or plain numbers (bytes,
seconds). Bad input raises :class:`~autotune.config.ConfigError` (a ``ValueError``) whose
message says what to do. Nothing here imports torch: only the ranks of a real probe do.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import (
    DEVICES,
    LADDER_ONLY,
    PLANNED_KNOBS,
    Attention,
    ConfigError,
    Engine,
    Knobs,
    Loss,
    LossDtype,
    NothingFits,
    Optimizer,
    Precision,
    TrainConfig,
    parse_choice,
    parse_losses,
    parse_optimizers,
)
from autotune.devices import Device, LocalDevice, ReplayDevice, SimulatedDevice
from autotune.devices.base import SetupResult, SetupStep
from autotune.estimator.host import estimate_host, usable_host_bytes
from autotune.estimator.memory import estimate_memory
from autotune.estimator.plan import (
    DEVICE_RESERVE_BYTES,
    PlanRow,
    point_estimates,
    usable_bytes,
)
from autotune.estimator.plan import plan as plan_rows
from autotune.estimator.rlhf import RLHFRow
from autotune.estimator.rlhf import plan_rlhf as rlhf_rows
from autotune.hardware import (
    GpuSpec,
    cpu_device_spec,
    detect_gpus,
    gpu_spec,
    host_memory_bytes,
)
from autotune.jobs import JobResult
from autotune.launch import Format, Launch, knob_notes, render, value_notes
from autotune.models import ModelSpec, resolve_model
from autotune.outputs import check_output, write_new_file
from autotune.probe.launcher import folder_hint, new_probe_dir
from autotune.probe.nodes import Nodes, nodes_from_environment
from autotune.probe.result import ProbeResult
from autotune.probe.spec import ProbeSpec, ProbeTemplate
from autotune.rlhf import (
    Algorithm,
    Placement,
    RLHFModels,
    RLHFProbe,
    RLHFWorkload,
    check_critic,
    check_models,
    is_absent,
    parse_placements,
    parse_shares,
    role_names,
)
from autotune.rlhf_launch import RLFormat, RLHFLaunch, render_rlhf
from autotune.script import (
    FRAMEWORK_ENGINES,
    KNOB_FLAGS,
    Framework,
    ScriptJob,
    check_engines,
    flag_value,
    job_command,
    shell_text,
)
from autotune.space import Workload
from autotune.study.fingerprint import (
    DEFAULT_STORAGE,
    Fingerprint,
    Objective,
    software_versions,
)
from autotune.study.measurement import (
    Measurement,
    StudyResult,
    best_point,
    measured_workload,
)
from autotune.study.urls import masked
from autotune.units import format_bytes, parse_duration, parse_fraction, parse_size

if TYPE_CHECKING:
    from autotune.jobs import Freshness, Job
    from autotune.search.controller import Controller, Event, RunSummary
    from autotune.search.rlhf import RLHFSummary
    from autotune.study.rlhf import RLHFTrial
    from autotune.study.store import TrialStore

# NOTE: the study (Optuna, SQLAlchemy) and the search are imported inside the functions that
# use them: `autotune plan` and `--help` never open a study, and answer faster without them.

__all__ = [
    "Export",
    "JobResult",
    "Plan",
    "RLHFPlan",
    "Report",
    "StudyResult",
    "Tuning",
    "best",
    "export",
    "export_rlhf",
    "plan",
    "plan_rlhf",
    "prepare",
    "probe",
    "trials",
    "tune",
    "tune_rlhf",
    "write_report",
]

PER_GPU_BATCH = 8
"""Global batch per GPU when none is given (sequences)."""
DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence when none is given, for a model that takes as many positions."""


def _seconds(value: str | float, what: str) -> float:
    seconds = parse_duration(value) if isinstance(value, str) else float(value)
    if seconds <= 0:
        raise ConfigError(f"{what} must be positive, like 30m")
    return seconds


def _bytes(value: str | int | None, what: str, *, zero: bool = False) -> int | None:
    if value is None:
        return None
    size = parse_size(value) if isinstance(value, str) else int(value)
    if size < 0 or (size == 0 and not zero):
        raise ConfigError(f"{what} must be a positive size, like 20GiB")
    return size


def _reserve(value: str | int, gpu: GpuSpec) -> int:
    """``--reserve``: device memory kept from the plan, less than the whole card."""
    reserve = _bytes(value, "--reserve", zero=True) or 0
    if reserve >= gpu.memory_bytes:
        raise ConfigError(
            f"--reserve {format_bytes(reserve)} is all of the {gpu.name}'s "
            f"{format_bytes(gpu.memory_bytes)} or more: leave it out (default "
            f"{format_bytes(DEVICE_RESERVE_BYTES)}) or keep it below the card's memory"
        )
    return reserve


def _fraction(value: str | float, what: str) -> float:
    if isinstance(value, str):
        return parse_fraction(value, what)
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{what} {value!r} must be between 0 and 1")
    return float(value)


def _gpu(gpu: str | GpuSpec | None) -> tuple[GpuSpec, int]:
    """The GPU named (a catalogue key or a .toml file) or detected here, and the count here."""
    detected = detect_gpus()
    here = detected.count if detected else 1
    if isinstance(gpu, GpuSpec):
        return gpu, here
    if gpu is not None:
        return gpu_spec(gpu), here
    if detected is None:
        raise ConfigError("no GPU detected: name the target with --gpu h100-80gb (or a .toml file)")
    if detected.spec is None:
        raise ConfigError(
            f"{detected.name} is not in the GPU catalogue: describe it in a .toml file and pass "
            "--gpu that-file.toml (see docs/gpus.md)"
        )
    return detected.spec, detected.count


def _workload(
    spec: ModelSpec, seq_len: int | None, global_batch: int | None, world_size: int
) -> Workload:
    batch = global_batch if global_batch is not None else PER_GPU_BATCH * world_size
    return Workload(seq_len=_seq_len(spec, seq_len), global_batch=batch, world_size=world_size)


def _seq_len(spec: ModelSpec, seq_len: int | None) -> int:
    """The sequence length asked for, or by default ``DEFAULT_SEQ_LEN`` capped at the model's
    positions (a 1,024-position GPT-2 is tuned at 1,024 unless told otherwise).

    Raises:
        ConfigError: A sequence longer than the model's positions: its position embeddings or
            RoPE range end there (a config that scales RoPE, ``rope_scaling``, states its own
            range).
    """
    longest = spec.max_position_embeddings
    if seq_len is None:
        return min(DEFAULT_SEQ_LEN, longest)
    if seq_len > longest and not spec.config.get("rope_scaling"):
        raise ConfigError(
            f"--seq-len {seq_len} is longer than {spec.name} takes ({longest} positions, "
            f"max_position_embeddings): use --seq-len {longest} or less, or a config.json that "
            "extends it (rope_scaling)"
        )
    return seq_len


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every configuration of a workload on a GPU, ranked by predicted throughput."""

    model: ModelSpec
    gpu: GpuSpec
    workload: Workload
    rows: list[PlanRow]
    seconds: float
    """How long the prediction took."""
    host: HostAssumed
    """The host the plan assumes for offload: its memory and cores, and where they come
    from."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "gpu": self.gpu.key,
            "gpus": self.workload.world_size,
            "seq_len": self.workload.seq_len,
            "global_batch": self.workload.global_batch,
            "loss_dtype": self.workload.loss_dtype.value,
            "predicted": True,
            "seconds": self.seconds,
            "host": self.host.to_dict(),
            "rows": [row.to_dict() for row in self.rows],
        }


@dataclass(frozen=True, kw_only=True)
class HostAssumed:
    """The host a plan assumes: a node's memory for the job and its CPU cores (host Adam
    under offload runs on them), each with where it comes from."""

    memory_bytes: int | None
    """None: the host memory is not checked."""
    cores: int | None
    """None: 16 cores per GPU, the estimator's default."""
    memory_from: str
    cores_from: str

    def text(self) -> str:
        memory = (
            "host memory not checked"
            if self.memory_bytes is None
            else f"host memory {format_bytes(self.memory_bytes)}"
        )
        cores = "16 cores per GPU" if self.cores is None else f"{self.cores} cores"
        return f"host: {memory} ({self.memory_from}); {cores} ({self.cores_from})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_bytes": self.memory_bytes,
            "memory_from": self.memory_from,
            "cores": self.cores,
            "cores_from": self.cores_from,
        }


def _host_assumed(memory: int | None, cores: int | None, *, here: bool) -> HostAssumed:
    """The host a plan assumes: what was given, else this node's when the plan is for this
    node, else none checked and 16 cores per GPU (a plan for another node must not take this
    machine's figures: give ``--host-memory`` and ``--host-cores`` for it)."""
    elsewhere = "a plan for another node"
    if memory is not None:
        memory_from = "--host-memory"
    elif here:
        memory, memory_from = host_memory_bytes(), "this node's"
    else:
        memory_from = f"{elsewhere}: give --host-memory to check it"
    if cores is not None:
        cores_from = "--host-cores"
    elif here:
        cores, cores_from = os.cpu_count() or 1, "this node's"
    else:
        cores_from = f"{elsewhere}: the estimator's default; --host-cores sets it"
    return HostAssumed(
        memory_bytes=memory, cores=cores, memory_from=memory_from, cores_from=cores_from
    )


def plan(
    model: str | ModelSpec,
    *,
    gpu: str | GpuSpec | None = None,
    gpus: int | None = None,
    gpus_per_node: int = 8,
    seq_len: int | None = None,
    global_batch: int | None = None,
    engines: Iterable[Engine] | None = None,
    precision: Precision | None = None,
    attention: Attention = Attention.SDPA,
    headroom: str | float = 0.0,
    reserve: str | int = DEVICE_RESERVE_BYTES,
    host_memory: str | int | None = None,
    host_cores: int | None = None,
    losses: str | Iterable[Loss | str] | None = None,
    op_checkpointing: bool = True,
    optimizers: str | Iterable[Optimizer | str] | None = None,
    lora_rank: int | None = None,
    activation_offload: bool = True,
    offload: bool = True,
    loss_dtype: LossDtype | str = LossDtype.FP32,
) -> Plan:
    """Predict peak memory and throughput of every configuration (no GPU needed).

    Args:
        model: A preset name, a path to a Hugging Face config.json, or a spec.
        gpu: The GPU (catalogue key or .toml file); default: the one detected here.
        gpus: GPUs in all; default: those here.
        gpus_per_node: GPUs sharing a node's fast links.
        seq_len: Tokens per sequence; default 2048, or the model's positions if fewer.
        global_batch: Sequences per optimizer step; default 8 per GPU.
        engines: Only these engines.
        precision: Default: bf16-mixed, fp16-mixed on GPUs without bf16.
        attention: The attention kernel.
        headroom: Memory a fitting configuration leaves free (``"10%"`` or 0.1).
        reserve: Device memory kept for the CUDA context and the allocator.
        host_memory: Host memory of a node for the job (``"125GiB"``); default: what this
            node gives it (its RAM, or its container's limit) when the plan is for this
            node's GPU, else not checked.
        host_cores: CPU cores of a node; default: this node's when the plan is for its GPU,
            else 16 per GPU.
        losses: The losses to try (``"full,chunked"``); default both, the chunked one where
            it pays.
        op_checkpointing: Try op-level selective checkpointing (``ac:ops``) where it pays.
        optimizers: The optimizers to try (``"adamw,adamw-8bit"``); default both, 8-bit
            AdamW where it pays.
        lora_rank: Also plan LoRA at this rank (``--allow lora``): rows of another training,
            ranked after every full fine-tuning row that fits; None: full fine-tuning alone.
        activation_offload: Try activation offload (``act:host``) where it pays.
        offload: Include the CPU-offload rungs (``--no-offload`` leaves them out).
        loss_dtype: The dtype your job's loss takes the logits in (``fp32``: the model's own
            loss, as autotune's stand-in and exports; ``logits``: their own, as a plain loop
            in pure bf16 takes them). ``run --script`` measures it instead.
    """
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    _check_attention(Attention(attention), "plan", precision)
    knobs = Knobs(
        losses=parse_losses(losses) or PLANNED_KNOBS.losses,
        op_checkpointing=op_checkpointing,
        optimizers=parse_optimizers(optimizers) or PLANNED_KNOBS.optimizers,
        lora_rank=_lora_rank(lora_rank),
        activation_offload=activation_offload,
    )
    target, here = _gpu(gpu)
    detected = detect_gpus() if gpu is not None else None
    local = gpu is None or (
        detected is not None and detected.spec is not None and detected.spec.key == target.key
    )
    host = _host_assumed(
        _bytes(host_memory, "--host-memory"), _count(host_cores, "--host-cores"), here=local
    )
    workload = _workload(spec, seq_len, global_batch, _count(gpus, "--gpus") or here)
    chosen = parse_choice(LossDtype, loss_dtype, "loss dtype") or LossDtype.FP32
    workload = dataclasses.replace(workload, loss_dtype=chosen)
    started = time.perf_counter()
    rows = plan_rows(
        spec,
        target,
        workload,
        engines=engines,
        precision=precision,
        attention=attention,
        gpus_per_node=gpus_per_node,
        reserve=_reserve(reserve, target),
        headroom=_fraction(headroom, "headroom"),
        host_memory_bytes=host.memory_bytes,
        host_cores=host.cores,
        knobs=knobs,
        offload=offload,
    )
    return Plan(
        model=spec,
        gpu=target,
        workload=workload,
        rows=rows,
        seconds=time.perf_counter() - started,
        host=host,
    )


@dataclass(frozen=True, kw_only=True)
class RLHFPlan:
    """Every layout of an RL iteration on a GPU, ranked by predicted samples per second."""

    workload: RLHFWorkload
    gpu: GpuSpec
    rows: list[RLHFRow]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        w, models = self.workload, self.workload.models
        return {
            "rlhf": w.algorithm.value,
            "models": {
                role: None if m is None else m.name
                for role, m in (
                    ("policy", models.policy),
                    ("reference", models.reference),
                    ("critic", models.critic),
                    ("reward", models.reward),
                )
            },
            "gpu": self.gpu.key,
            "gpus": w.world_size,
            "seq_len": w.seq_len,
            "response_len": w.response_len,
            "rollout_batch": w.rollout_batch,
            "predicted": True,
            "assumed": "the rollout's speed and the engine's overheads (docs/rlhf.md)",
            "seconds": self.seconds,
            "fits": any(row.fits for row in self.rows),
            "rows": [row.to_dict() for row in self.rows],
        }


RLHF_CPU_NEEDS_A_CAP = (
    "--rlhf on the CPU needs --device-memory, e.g. 64MiB: the engine's share is a share of it"
)


def _role_model(value: str | ModelSpec | None, default: ModelSpec | None) -> ModelSpec | None:
    """A role's model: as given (a preset, a config.json, ``none``), else ``default``."""
    if isinstance(value, ModelSpec):
        return value
    if value is None:
        return default
    return None if is_absent(value) else resolve_model(value)


def plan_rlhf(
    algorithm: str | Algorithm,
    model: str | ModelSpec = "llama-7b",
    *,
    gpu: str | GpuSpec | None = None,
    gpus: int | None = None,
    gpus_per_node: int = 8,
    seq_len: int | None = None,
    response_len: int | None = None,
    rollout_batch: int | None = None,
    reference: str | ModelSpec | None = None,
    critic: str | ModelSpec | None = None,
    reward: str | ModelSpec | None = None,
    rollout_share: str | float | None = None,
    sleep: bool | None = None,
    frozen: str | None = None,
    engines: Iterable[Engine] | None = None,
    precision: Precision | None = None,
    offload: bool = False,
    reserve: str | int = DEVICE_RESERVE_BYTES,
) -> RLHFPlan:
    """Predict every layout of a PPO or GRPO iteration with a colocated rollout engine.

    Args:
        algorithm: ``ppo`` (policy and critic trained) or ``grpo`` (no critic).
        model: The policy: a preset, a config.json or a spec.
        gpu, gpus, gpus_per_node: The GPUs, as for :func:`plan`.
        seq_len: Tokens of a sequence, prompt and response (default as :func:`plan`).
        response_len: Tokens generated per sequence (default: half the sequence).
        rollout_batch: Sequences an iteration generates and trains on, all GPUs (default 2
            per GPU).
        reference, critic, reward: Each role's model (a preset, a config.json, or ``none``
            for absent); default: the policy's shape (PPO's critic; GRPO has none).
        rollout_share: The engine's share of each GPU (``0.5``, ``50%``, ``0.4,0.6``);
            default: every share of :data:`autotune.rlhf.SHARES`.
        sleep: Whether the engine sleeps during scoring and training; None: both.
        frozen: Where the frozen models wait: ``gpu``, ``host`` or ``gpu,host`` (default).
        engines: The trainer's engines; default DeepSpeed ZeRO (OpenRLHF's and TRL's
            trainer), every stage.
        precision: The trainer's precision.
        offload: Also try the trainer's CPU offload (off by default: the host link carries
            the engine's sleep and the offloaded frozen models every iteration).
        reserve: Device memory kept for the CUDA context.
    """
    try:
        algo = Algorithm(algorithm)
    except ValueError:
        raise ConfigError(f"--rlhf {algorithm!r}: use ppo or grpo") from None
    if algo is Algorithm.GRPO and critic is not None and not is_absent(critic):
        check_critic(algo, True)  # before the critic is looked up: one line, not a lookup's
    policy = model if isinstance(model, ModelSpec) else resolve_model(model)
    target, here = _gpu(gpu)
    world = _count(gpus, "--gpus") or here
    length = _seq_len(policy, seq_len)
    models = RLHFModels(
        policy=policy,
        reference=_role_model(reference, policy),
        critic=_role_model(critic, policy if algo is Algorithm.PPO else None),
        reward=_role_model(reward, policy),
    )
    work = RLHFWorkload(
        algorithm=algo,
        models=models,
        seq_len=length,
        response_len=_count(response_len, "--response-len") or length // 2,
        rollout_batch=_count(rollout_batch, "--rollout-batch") or 2 * world,
        world_size=world,
    )
    started = time.perf_counter()
    rows = rlhf_rows(
        work,
        target,
        shares=parse_shares(rollout_share),
        sleeps=(False, True) if sleep is None else (sleep,),
        placements=parse_placements(frozen),
        engines=list(engines) if engines is not None else [Engine.DEEPSPEED],
        precision=precision,
        offload=offload,
        gpus_per_node=gpus_per_node,
        reserve=_reserve(reserve, target),
    )
    return RLHFPlan(workload=work, gpu=target, rows=rows, seconds=time.perf_counter() - started)


def tune_rlhf(
    algorithm: str | Algorithm,
    model: str,
    *,
    device: str = "auto",
    device_memory: str | int | None = None,
    gpus: int | None = None,
    seq_len: int | None = None,
    response_len: int | None = None,
    rollout_batch: int | None = None,
    reference: str | None = None,
    critic: str | None = None,
    reward: str | None = None,
    rollout_share: str | float | None = None,
    sleep: bool | None = None,
    frozen: str | None = None,
    engines: Iterable[Engine] | None = None,
    precision: Precision | None = None,
    budget: str | float = "30m",
    storage: str = DEFAULT_STORAGE,
    trials_dir: str | Path = "trials",
    max_probes: int = 12,
    on_probe: Callable[[RLHFTrial, RLHFRow, RLHFTrial | None], None] | None = None,
) -> RLHFSummary:
    """Search an RL iteration's layouts with real probes (:mod:`autotune.search.rlhf`): the
    planner's rows for one GPU, each probed as an iteration (:func:`probe` with ``rlhf``),
    every probe a trial of the workload's RLHF study, resumed from it.

    On one node; the trainer's engines default to ``single`` on one GPU, FSDP2 and DDP on
    several (``engines``); the frozen models wait on the host only on one rank. Where the engine
    is emulated (every probe: vLLM does not run in one), an iteration's speed counts the
    probe's measured scoring and training and the predicted rollout and switch.

    Args:
        algorithm, model, reference, critic, reward, seq_len, response_len, rollout_batch,
            rollout_share, sleep, engines, precision: As for :func:`plan_rlhf`.
        device: ``cuda``, ``cpu`` (real CPU probes under ``device_memory``) or ``auto``.
        device_memory: The emulated cap per rank (required on the CPU).
        gpus: Ranks (GPUs, or CPU processes each under ``device_memory``), on this node.
        budget: Wall-clock budget (``"30m"``).
        storage: The study's storage URL.
        trials_dir: Where probe folders go (``trials_dir/rlhf/N``).
        max_probes: Probes at most this run.
        on_probe: Called after each probe with its trial, its predicted row and the best.
    """
    from autotune.search.rlhf import RLHFSummary, measured_speed
    from autotune.search.rlhf import search as search_rlhf
    from autotune.study.rlhf import RLHFStudy, RLHFTrial

    world = _count(gpus, "--gpus") or 1
    if world > 1 and frozen is not None and Placement.OFFLOAD in parse_placements(frozen):
        raise ConfigError(
            "--frozen host is probed on one rank (its weights are not moved to the host in "
            "shards yet): use --frozen gpu with --gpus, or --gpus 1"
        )
    budget_s = _seconds(budget, "the budget")
    kind = device
    if kind == "auto":
        kind = "cuda" if detect_gpus() else "cpu"
    if kind not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {device!r}: use cuda, cpu or auto")
    cap = _bytes(device_memory, "--device-memory")
    if kind == "cpu" and cap is None:
        raise ConfigError(RLHF_CPU_NEEDS_A_CAP)
    target = cpu_device_spec(cap) if kind == "cpu" and cap else _gpu(None)[0]
    if kind == "cuda" and cap is not None:
        target = dataclasses.replace(target, memory_bytes=cap)
    found = plan_rlhf(
        algorithm,
        model,
        gpu=target,
        gpus=world,
        seq_len=seq_len,
        response_len=response_len,
        rollout_batch=rollout_batch,
        reference=reference,
        critic=critic,
        reward=reward,
        rollout_share=rollout_share,
        sleep=sleep,
        frozen=frozen if world == 1 else Placement.RESIDENT.value,
        engines=list(engines) if engines is not None else _rlhf_engines(world),
        precision=precision,
        reserve=0 if kind == "cpu" or cap is not None else DEVICE_RESERVE_BYTES,
    )
    work, models = found.workload, found.workload.models

    names = role_names(work.algorithm, model, reference=reference, critic=critic, reward=reward)
    study = RLHFStudy(
        {
            "algorithm": work.algorithm.value,
            "policy": models.policy.name,
            "policy_model": model,
            "models": names,
            "seq_len": work.seq_len,
            "response_len": work.response_len,
            "rollout_batch": work.rollout_batch,
            "gpus": world,
            "hardware": f"{world}x{target.key}" + (f"-cap{cap}" if cap else ""),
            "device": kind,
        },
        storage=storage,
    )
    local = LocalDevice(kind, warm=False)
    started = time.monotonic()
    durations: list[float] = []

    def run_one(row: RLHFRow) -> RLHFTrial:
        spec = ProbeSpec(
            model=model,
            config=row.config,
            micro_batch_sizes=(row.micro_batch_size,),
            seq_len=work.seq_len,
            grad_accum=row.grad_accum,
            num_processes=world,
            device=kind,
            device_memory_bytes=cap,
            warmup_steps=1,
            timed_steps=1,
            timeout_s=max(60.0, budget_s),
            rlhf=RLHFProbe(
                algorithm=work.algorithm,
                reference=names["reference"],
                critic=names["critic"],
                reward=names["reward"],
                share=row.share,
                sleep=row.sleep,
                frozen=row.frozen,
            ),
        )
        for step in local.setup(spec):
            step.run()
        began = time.monotonic()
        result = local.launch(spec, new_probe_dir(Path(trials_dir), "rlhf"))
        durations.append(time.monotonic() - began)
        size = result.sizes[0] if result.sizes else None
        outcome = size.outcome.value if size is not None else result.outcome.value
        phases = size.extra.get("rlhf", {}) if size is not None else {}
        speed = 0.0
        if size is not None and size.outcome.value == "ok" and phases:
            speed = measured_speed(row, phases["phase_s"], emulated=True)
        trial = study.record(
            RLHFTrial(
                config=row.config,
                share=row.share,
                sleep=row.sleep,
                frozen=row.frozen,
                micro_batch_size=row.micro_batch_size,
                outcome=outcome,
                samples_per_second=speed,
                stage=None if size is None or size.stage is None else str(size.stage),
                phases=phases.get("phase_peak_bytes", {}),
                seconds=phases.get("phase_s", {}),
                probe_dir=str(result.probe_dir),
            )
        )
        if on_probe is not None:
            on_probe(trial, row, study.best())
        return trial

    try:
        trials, made, why = search_rlhf(
            found.rows,
            study.trials(),
            run_one,
            budget_left=lambda: budget_s - (time.monotonic() - started),
            cost=lambda row: max(durations, default=0.0),
            max_probes=max_probes,
        )
    finally:
        local.close()
    return RLHFSummary(
        study=study.name, trials=trials, probes=made, stop_reason=why, best=study.best()
    )


@dataclass(frozen=True, kw_only=True)
class RLHFExport:
    """An RLHF study's best layout in an RL framework's options."""

    study: str
    trial: RLHFTrial
    launch: RLHFLaunch
    format: RLFormat
    text: str
    notes: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "trial": self.trial.number,
            "format": self.format.value,
            "layout": self.trial.to_dict(),
            "text": self.text,
            "notes": list(self.notes),
        }


def _rlhf_engines(world: int) -> list[Engine]:
    """The trainer engines ``run --rlhf`` tries unless told: one process on one GPU; FSDP2 and
    DDP over several (their probes start in seconds; DeepSpeed's build ops first)."""
    return [Engine.SINGLE] if world == 1 else [Engine.FSDP, Engine.DDP]


def export_rlhf(
    fmt: str,
    *,
    model: str | None = None,
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
) -> RLHFExport:
    """The best layout of an RLHF study (``run --rlhf``) as TRL's ``GRPOConfig`` fields,
    OpenRLHF's flags or verl's overrides: the study named, else the newest of ``model``'s
    (the policy) in which a layout fitted, else the newest such study.

    Raises:
        ConfigError: No such study, nothing fitted in it, or a format that cannot express it.
    """
    from autotune.study.rlhf import RLHFStudy

    chosen_format = RLFormat(fmt)
    studies = RLHFStudy.existing(storage)
    if study is not None:
        studies = [s for s in studies if s.name == study]
    elif model is not None:
        name = resolve_model(model).name
        studies = [s for s in studies if s.workload.get("policy") == name]
    if not studies:
        what = f"study {study!r}" if study else f"RLHF study of {model}" if model else "RLHF study"
        raise ConfigError(
            f"no {what} in {masked(storage)}: run autotune run --rlhf first, or pass --storage"
        )
    # The newest study with a layout that fitted (a newer one may hold no probe yet).
    fitted = [(s, best) for s in studies if (best := s.best()) is not None]
    if not fitted:
        found = studies[-1]
        if not found.trials():
            raise ConfigError(
                f"{found.name} holds no probe yet: nothing to export; run autotune run --rlhf "
                "with its options to probe it"
            )
        raise ConfigError(
            f"no layout of {found.name} fitted: nothing to export; lower --rollout-share or "
            "let the engine --sleep, and run again"
        )
    found, best = fitted[-1]
    w = found.workload
    roles = w.get("models", {})
    policy = str(w.get("policy_model", w["policy"]))
    world = int(w.get("gpus", 1))
    launch = RLHFLaunch(
        algorithm=Algorithm(w["algorithm"]),
        policy=policy,
        reference=roles.get("reference"),
        critic=roles.get("critic"),
        reward=roles.get("reward"),
        hidden_size=resolve_model(policy).hidden_size,
        config=best.config,
        micro_batch_size=best.micro_batch_size,
        grad_accum=max(1, int(w["rollout_batch"]) // (best.micro_batch_size * world)),
        world_size=world,
        seq_len=int(w["seq_len"]),
        response_len=int(w["response_len"]),
        rollout_batch=int(w["rollout_batch"]),
        share=best.share,
        sleep=best.sleep,
        frozen=best.frozen,
    )
    text, notes = render_rlhf(launch, chosen_format)
    return RLHFExport(
        study=found.name, trial=best, launch=launch, format=chosen_format, text=text, notes=notes
    )


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """A tuning run, assembled: the study, the predictions, the device and the budget."""

    model: ModelSpec
    gpu: GpuSpec
    """The GPU the estimator plans for (on the CPU: a stand-in with the emulated cap)."""
    device: Device
    store: TrialStore
    rows: list[PlanRow]
    template: ProbeTemplate
    budget_s: float
    trials_dir: Path
    storage: str
    """The storage URL, as given."""
    replan: Callable[[Workload], list[PlanRow]] | None = None
    """The planner's predictions for another workload (a user's job, once its probes have
    measured it otherwise than assumed: ``measured_workload``); None: the rows stand."""

    @property
    def fingerprint(self) -> Fingerprint:
        return self.store.fingerprint

    @property
    def workload(self) -> Workload:
        return self.store.workload

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    def controller(self, on_event: Callable[[Event], None] | None = None) -> Controller:
        """The search loop of this run (a fresh budget clock)."""
        # Imported here: reading a study back (`best`, `trials`) needs no search.
        from autotune.search.controller import Controller

        return Controller(
            store=self.store,
            rows=self.rows,
            device=self.device,
            template=self.template,
            budget_s=self.budget_s,
            trials_dir=self.trials_dir,
            on_event=on_event,
            replan=self.replan,
        )

    def run(self, on_event: Callable[[Event], None] | None = None) -> RunSummary:
        """Search until done, the budget is spent, or Ctrl-C (then: the best so far). The
        device's warm workers stop with the run."""
        try:
            return self.controller(on_event).run()
        finally:
            self.device.close()


def _device(
    device: str | Device,
    simulate: str | None,
    seed: int,
    cap: int | None,
    host: int | None,
    *,
    warm: bool,
    nodes: Nodes | None = None,
    cores: int | None = None,
) -> tuple[Device, GpuSpec, int]:
    """The device that answers probes, the GPU to plan for and the GPUs here (on each node)."""
    if isinstance(device, str) and device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}: use {', '.join(DEVICES)}")
    if simulate is not None:
        simulated = SimulatedDevice.named(
            simulate, seed=seed, host_memory_bytes=host, host_cores=cores
        )
        return simulated, simulated.gpu, 8
    if isinstance(device, SimulatedDevice):
        return device, device.gpu, 8
    if isinstance(device, ReplayDevice):
        return device, device.gpu, device.grid.key.num_processes  # the recordings' CPU or GPU
    if isinstance(device, str):
        if device == "auto":
            if detect_gpus() is None:
                raise ConfigError(
                    "no GPU found: use --device cpu --device-memory 64MiB (real CPU probes) "
                    "or --simulate h100-80gb (the estimator's simulated GPU)"
                )
            device = "cuda"
        device = LocalDevice(device, warm=warm, nodes=nodes)
    if device.kind == "cpu":
        if cap is None:
            raise ConfigError("--device cpu needs --device-memory, e.g. 64MiB, to emulate a GPU")
        return device, cpu_device_spec(cap), 1
    gpu, here = _gpu(None)
    return device, gpu, here


def _host_for(device: Device, given: int | None) -> int | None:
    """The host memory a run plans for: as given, the simulated or recorded node's, or this
    node's."""
    if isinstance(device, SimulatedDevice | ReplayDevice):
        return device.host_memory_bytes if device.host_memory_bytes is not None else given
    return given if given is not None else host_memory_bytes()


def _cores_for(device: Device, given: int | None) -> int | None:
    """The host cores a run plans for: as given, the simulated node's, or this node's (None
    for a recorded grid: 16 per GPU)."""
    if isinstance(device, SimulatedDevice):
        return device.host_cores
    if isinstance(device, ReplayDevice):
        return given
    return given if given is not None else os.cpu_count()


def prepare(model: str | None, **options: Any) -> Tuning:
    """Assemble a tuning run without starting it (see :func:`tune` for the arguments).

    Opens (or creates) the study, so a bad storage URL fails here.
    """
    tuning = _prepare(model, **options)
    if tuning is None:
        raise AssertionError("only a check_only preparation stops before its tuning")
    return tuning


def _check(model: str | None, **options: Any) -> None:
    """Check a run's options as :func:`prepare` does (every check in its one home), opening,
    creating and starting nothing: the storage is checked by its URL and, for a SQLite file,
    by what the file holds (never created); the trials folder by what is in its way.

    Raises:
        ConfigError: What :func:`prepare` would refuse. Whether anything fits is not asked
            (:class:`~autotune.config.NothingFits` is a run's answer, not bad input).
    """
    _prepare(model, check_only=True, **options)


def _prepare(
    model: str | None,
    *,
    budget: str | float = "30m",
    seq_len: int | None = None,
    global_batch: int | None = None,
    gpus: int | None = None,
    engines: Iterable[Engine] | None = None,
    precision: Precision | str | None = None,
    attention: Attention | str = Attention.SDPA,
    device: str | Device = "auto",
    simulate: str | None = None,
    device_memory: str | int | None = None,
    headroom: str | float = 0.0,
    host_memory: str | int | None = None,
    host_cores: int | None = None,
    objective: Objective | str = Objective.TOKENS,
    storage: str = DEFAULT_STORAGE,
    trials_dir: str | Path = "trials",
    seed: int = 0,
    warmup_steps: int = 2,
    timed_steps: int = 3,
    warm: bool = True,
    nodes: int | None = None,
    hosts: str | Sequence[str] | None = None,
    script: str | Path | None = None,
    framework: str | None = None,
    script_args: Sequence[str] = (),
    batch_flag: str | None = None,
    accum_flag: str | None = None,
    checkpointing_flag: str | None = None,
    losses: str | Iterable[Loss | str] | None = None,
    op_checkpointing: bool = False,
    optimizers: str | Iterable[Optimizer | str] | None = None,
    lora_rank: int | None = None,
    activation_offload: bool = False,
    check_only: bool = False,
) -> Tuning | None:
    """:func:`prepare`, or with ``check_only`` :func:`_check` (None)."""
    job = _script_job(
        script,
        framework,
        script_args,
        (batch_flag, accum_flag, checkpointing_flag),
        simulate=simulate,
        device=device,
    )
    asked = (parse_losses(losses), op_checkpointing, parse_optimizers(optimizers))
    # A script's own loss and optimizer, before anything opens.
    _knobs(job, *asked, "simulated", lora_rank=lora_rank, activation_offload=activation_offload)
    if job is not None:
        model = model or _script_model(job)
        engines = _job_engines(job, engines)
        if (nodes or 1) > 1 or hosts:
            raise ConfigError("--script runs on one node: leave out --nodes and --hosts")
    if model is None:
        raise ConfigError("give --model: a preset name or the path of a config.json")
    spec = resolve_model(model)
    budget_s = _seconds(budget, "the budget")
    cap = _bytes(device_memory, "--device-memory")
    host = _bytes(host_memory, "--host-memory")
    cores = _count(host_cores, "--host-cores")
    layout = _nodes(nodes, hosts, simulated=simulate is not None or not isinstance(device, str))
    count = layout.count if layout is not None else (nodes or 1)
    if isinstance(device, ReplayDevice) and cap is None:
        cap = device.grid.key.device_memory_bytes  # the cap the grid was recorded under
    chosen, gpu, here = _device(
        device, simulate, seed, cap, host, warm=warm, nodes=layout, cores=cores
    )
    per_node = _per_node(gpus, count, here)
    world = per_node * count
    workload = _workload(spec, seq_len, global_batch, world)
    goal = Objective(objective) if objective in set(Objective) else None
    if goal is None:
        choices = " or ".join(o.value for o in Objective)
        raise ConfigError(f"unknown objective {objective!r}: use {choices}")
    # Real CPU probes, or their recordings replayed: an emulated device, no host to offload to.
    on_cpu = chosen.kind == "cpu" or (
        isinstance(chosen, ReplayDevice) and chosen.grid.device == "cpu"
    )
    if goal is Objective.MFU and on_cpu:
        raise ConfigError(
            "--objective mfu needs a GPU's peak FLOP/s: use --objective tokens on the CPU"
        )
    _check_ranks(chosen, per_node, here)
    knobs = _knobs(
        job,
        *asked,
        "cpu" if on_cpu else chosen.kind,
        lora_rank=lora_rank,
        activation_offload=activation_offload,
    )
    if isinstance(chosen, ReplayDevice):  # a grid answers only what it recorded
        recorded = chosen.grid.knobs
        knobs = Knobs(
            losses=tuple(x for x in knobs.losses if x in recorded.losses) or (Loss.FULL,),
            op_checkpointing=knobs.op_checkpointing and recorded.op_checkpointing,
            optimizers=tuple(x for x in knobs.optimizers if x in recorded.optimizers)
            or (Optimizer.ADAMW,),
            activation_offload=knobs.activation_offload and recorded.activation_offload,
            block_patterns=knobs.block_patterns,
        )
    if cap is not None and not on_cpu and cap > gpu.memory_bytes:
        raise ConfigError(
            f"--device-memory {format_bytes(cap)} is more than the {gpu.key}'s "
            f"{format_bytes(gpu.memory_bytes)}: leave it out to use the whole card, or cap it lower"
        )
    capacity = cap if cap is not None else usable_bytes(gpu)
    chosen_precision = parse_choice(Precision, precision, "precision")
    chosen_attention = parse_choice(Attention, attention, "attention") or Attention.SDPA
    _check_attention(chosen_attention, "cpu" if on_cpu else chosen.kind, chosen_precision)
    software = software_versions()
    detected = detect_gpus() if chosen.kind == "cuda" else None
    if detected is not None and detected.driver:
        software["driver"] = detected.driver  # a new driver is another study
    fingerprint = Fingerprint(
        model=spec.name,
        seq_len=workload.seq_len,
        global_batch=workload.global_batch,
        gpu=gpu.key,
        gpu_memory_bytes=capacity,
        gpus=world,
        device=chosen.kind,
        objective=goal,
        software=software,
        capped=cap is not None,
        nodes=count,
        precision=None if chosen_precision is None else chosen_precision.value,
        attention=None if chosen_attention is Attention.SDPA else chosen_attention.value,
        script=None if job is None else job.to_dict(),
    )
    share = _fraction(headroom, "headroom")
    capped_gpu = gpu if cap is None or on_cpu else dataclasses.replace(gpu, memory_bytes=cap)

    def planned(workload: Workload) -> list[PlanRow]:
        return plan_rows(
            spec,
            capped_gpu,  # a cap is what the allocator may hold: the plan's capacity, no reserve
            workload,
            engines=engines,
            precision=chosen_precision,
            attention=chosen_attention,
            reserve=0 if on_cpu or cap is not None else DEVICE_RESERVE_BYTES,
            offload=not on_cpu,  # a CPU emulating a device has no host to offload to
            host_memory_bytes=_host_for(chosen, host),
            host_cores=_cores_for(chosen, cores),
            device="cpu" if on_cpu else "cuda",
            gpus_per_node=per_node if count > 1 else 8,  # one node: its links, up to 8 GPUs
            knobs=knobs,
            planned_out=True,  # the search revives a knob whose twin's prediction fails
        )

    rows = planned(workload)
    if check_only:
        from autotune.study.reader import check_storage

        check_storage(storage)
        _check_trials_dir(Path(trials_dir))
        chosen.close()
        return None
    _check_something_fits(rows, spec, world, capacity, on_cpu=on_cpu)
    from autotune.study.store import TrialStore

    store = TrialStore(fingerprint, storage=storage, headroom=share)
    if job is not None:
        # What an earlier run's probes measured of the job (the stand-in trains as asked).
        seen = measured_workload(workload, store.measurements())
        if seen != workload:
            store.workload = workload = seen
            rows = planned(workload)
    store.estimates = point_estimates(rows, workload)
    template = ProbeTemplate(
        model=model,
        seq_len=workload.seq_len,
        num_processes=per_node,
        nodes=count,
        device="cpu" if on_cpu else "cuda",
        device_memory_bytes=cap,
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        script=job,
        global_batch=workload.global_batch,
    )
    return Tuning(
        model=spec,
        gpu=gpu,
        device=chosen,
        store=store,
        rows=rows,
        template=template,
        budget_s=budget_s,
        trials_dir=Path(trials_dir),
        storage=storage,
        replan=None if job is None else planned,
    )


def _script_job(
    script: str | Path | None,
    framework: str | None,
    args: Sequence[str],
    flags: tuple[str | None, str | None, str | None],
    *,
    simulate: str | None,
    device: str | Device,
) -> ScriptJob | None:
    """The user's training job a run probes, checked (None: autotune's stand-in); ``flags``:
    the script's own for the micro-batch, the accumulation and checkpointing."""
    if script is None:
        named = [KNOB_FLAGS[k][0] for k, f in zip(KNOB_FLAGS, flags, strict=True) if f]
        if framework is not None or args or named:
            what = (
                "--framework"
                if framework is not None
                else named[0]
                if named
                else "arguments after --"
            )
            raise ConfigError(f"{what} without --script: name your training script")
        return None
    if framework is None:
        choices = " or ".join(f.value for f in Framework)
        raise ConfigError(f"--script needs --framework: {choices}")
    if simulate is not None or not isinstance(device, str):
        raise ConfigError("--script probes your job for real: leave out --simulate")
    batch, accum, checkpointing = flags
    return ScriptJob.read(
        script,
        framework,
        args,
        batch,
        accum_flag=accum,
        checkpointing_flag=checkpointing,
        recognise=True,  # a script's own --batch-size, --grad-accum, ... by their names
    )


def _script_model(job: ScriptJob) -> str:
    """The model a job names: the Trainer's ``--model_name_or_path`` when it is a local folder
    with a config.json."""
    found = flag_value(job.args, "model_name_or_path")
    if job.framework is Framework.HF and found and (Path(found) / "config.json").is_file():
        return found
    raise ConfigError(
        "give --model with --script: the preset or config.json of the model the script trains"
    )


SEARCHED_KNOBS = LADDER_ONLY
"""The knobs ``run`` searches unless told: the ladder's alone. The chunked and fused losses
(``--loss full,chunked``), op-level checkpointing (``--ac-ops``) and 8-bit AdamW
(``--optimizer adamw,adamw-8bit``) are planned by default and searched when named: with them
in its space the search falls short of its goal on the benchmark's sets, where the best point
is often a configuration predicted not to fit whose memory the simulated error overstates
(docs/search.md, "The knobs beyond the ladder")."""


def _knobs(
    job: ScriptJob | None,
    losses: tuple[Loss, ...] | None,
    op_checkpointing: bool,
    optimizers: tuple[Optimizer, ...] | None,
    device: str = "cuda",
    lora_rank: int | None = None,
    activation_offload: bool = False,
) -> Knobs:
    """The knobs a run on ``device`` (a device kind: ``cuda``, ``cpu``, ``simulated``,
    ``replay``) tries: those asked, by default :data:`SEARCHED_KNOBS`. A user's script
    computes its own loss, checkpoints as its framework does and builds its own optimizer, so
    it is tried on the ladder alone.

    ``lora_rank``: LoRA allowed at this rank (``--allow lora``), searched once no full
    fine-tuning configuration is left that may fit; None: full fine-tuning alone.
    ``activation_offload``: search activation offload (``--act-offload``) too.

    Raises:
        ConfigError: A knob that cannot run there: the fused loss off a CUDA GPU or without
            ``liger-kernel``, 8-bit AdamW without ``torchao``, LoRA without ``peft``, any
            knob with a script.
    """
    if job is not None and lora_rank is not None:
        raise ConfigError(
            "--allow lora puts adapters on autotune's stand-in; your script builds its own "
            "model: leave out --allow lora with --script (wrap it with peft there)"
        )
    rank = _lora_rank(lora_rank)
    if rank:
        _need_peft("--allow lora", device)
    if job is not None:
        if losses is not None and set(losses) != {Loss.FULL}:
            raise ConfigError(
                "--loss chunked is a loss of autotune's stand-in; your script computes its "
                "own: leave out --loss with --script"
            )
        if optimizers is not None and set(optimizers) != {Optimizer.ADAMW}:
            raise ConfigError(
                "--optimizer adamw-8bit is an optimizer of autotune's stand-in; your script "
                "builds its own: leave out --optimizer with --script (a Trainer takes "
                'optim="adamw_torch_8bit")'
            )
        if activation_offload:
            raise ConfigError(
                "--act-offload wraps the blocks of autotune's stand-in; your script builds its "
                "own model: leave out --act-offload with --script (TRL's SFTConfig takes "
                "activation_offloading=True)"
            )
        # A script's own checkpointing switch: every block or none.
        return dataclasses.replace(LADDER_ONLY, block_patterns=job.checkpointing_flag is None)
    losses = losses or SEARCHED_KNOBS.losses
    optimizers = optimizers or SEARCHED_KNOBS.optimizers
    if Loss.FUSED in losses and device == "cpu":
        raise ConfigError(
            "--loss fused runs Liger-Kernel's Triton kernels on a CUDA GPU: use --loss "
            "chunked on the CPU (the same memory, one more forward of the output layer)"
        )
    probing = device in ("cuda", "cpu")
    if Loss.FUSED in losses and device == "cuda" and not _installed("liger_kernel"):
        raise ConfigError(
            "--loss fused needs Liger-Kernel: pip install liger-kernel, or use --loss chunked"
        )
    if Optimizer.ADAMW_8BIT in optimizers and probing and not _installed("torchao"):
        raise ConfigError(
            "--optimizer adamw-8bit needs torchao: pip install torchao, or use --optimizer adamw"
        )
    return Knobs(
        losses=losses,
        op_checkpointing=op_checkpointing,
        optimizers=optimizers,
        lora_rank=rank,
        activation_offload=activation_offload,
    )


def _stand_in_only(job: ScriptJob, config: TrainConfig) -> None:
    """Refuse, in one line, a field of ``config`` that only autotune's stand-in has, for a
    probe of the user's script ``job``, which builds its own model, loss and optimizer.

    Raises:
        ConfigError: The first such field set: a loss other than the full one, 8-bit AdamW,
            activation offload (through :func:`_knobs`, one home for their messages),
            op-level checkpointing, compiled blocks, LoRA.
    """
    _knobs(job, (config.loss,), False, (config.optimizer,))
    _knobs(job, None, False, None, activation_offload=config.act_offload)
    if config.ac_ops:
        raise ConfigError(
            "--ac ops is autotune's stand-in's checkpointing; your script checkpoints as its "
            "framework does: use --ac off, every or every-N with --script"
        )
    if config.torch_compile:
        raise ConfigError(
            "--compile compiles the blocks of autotune's stand-in; your script builds its own "
            "model: leave out --compile with --script (a Trainer takes torch_compile=True)"
        )
    if config.is_lora:
        raise ConfigError(
            "--lora-rank puts adapters on autotune's stand-in; your script builds its own "
            "model: leave out --lora-rank with --script (wrap it with peft there)"
        )


def _lora_rank(value: int | None) -> int:
    """LoRA's rank as asked (``--lora-rank`` with ``--allow lora``): 0 when not allowed (None);
    one line below 1."""
    return 0 if value is None else (_count(value, "--lora-rank") or 0)


def _need_peft(option: str, device: str) -> None:
    """Refuse LoRA where a probe would import peft and it is not installed."""
    if device in ("cuda", "cpu") and not _installed("peft"):
        raise ConfigError(f"{option} needs peft: pip install peft, or leave out {option}")


def _check_attention(attention: Attention, device: str, precision: Precision | None = None) -> None:
    """Refuse flash-attn's kernels where they cannot run: in fp32, off a CUDA GPU, or without
    the package (a plan or a simulated GPU predicts them on any GPU).

    Raises:
        ConfigError: ``--attention flash_attention_2 runs flash-attn's CUDA kernels ...``.
    """
    if attention is not Attention.FLASH:
        return
    if precision is not None:
        TrainConfig(precision=precision, attention=attention)  # 16-bit compute only
    if device == "cpu":
        raise ConfigError(
            "--attention flash_attention_2 runs flash-attn's CUDA kernels: use --attention "
            "sdpa on the CPU (torch's own flash kernel for the CPU)"
        )
    if device == "cuda" and not _installed("flash_attn"):
        raise ConfigError(
            "--attention flash_attention_2 needs flash-attn: pip install flash-attn, or use "
            "--attention sdpa (torch's flash kernel on Ampere and newer)"
        )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _job_engines(job: ScriptJob, engines: Iterable[Engine] | None) -> list[Engine]:
    """The engines a job's adapter can hand its framework, or those asked if it can."""
    if engines is None:
        return list(FRAMEWORK_ENGINES[job.framework])
    chosen = list(engines)
    check_engines(job, chosen)
    return chosen


def _nodes(
    nodes: int | None, hosts: str | Sequence[str] | None, *, simulated: bool
) -> Nodes | None:
    """The nodes real probes span (``--hosts``, or the Slurm allocation the run is in), or
    None for this node alone; a simulated device has no hosts (``nodes`` alone counts)."""
    _count(nodes, "--nodes")
    listed = [h.strip() for h in hosts.split(",")] if isinstance(hosts, str) else hosts
    if listed is not None and not all(listed):
        raise ConfigError(f"--hosts {hosts!r} has an empty name: use --hosts this-host,node2")
    if simulated:
        if listed:
            raise ConfigError("--hosts places real probes: leave it out with --simulate")
        return None
    return nodes_from_environment(os.environ, nodes=nodes, hosts=listed)


def _check_trials_dir(trials_dir: Path) -> None:
    """Refuse a trials folder no probe folder can be made in, making nothing: a file in the
    way (the folder itself, or one above it), or a folder that cannot be written. (A run
    finds out at its first probe; a job file's workloads are checked before the first runs.)

    Raises:
        ConfigError: ``no probe folder can be made in DIR (Not a directory): a file is in the
            way: give --trials-dir a folder``, or the like.
    """
    existing = trials_dir.absolute()
    try:
        while not existing.exists():
            existing = existing.parent
    except OSError as error:  # a folder above it cannot be read
        why = error.strerror or str(error)
    else:
        if not existing.is_dir():
            why = os.strerror(errno.ENOTDIR)
        elif not os.access(existing, os.W_OK | os.X_OK):
            why = os.strerror(errno.EACCES)
        else:
            return
    raise ConfigError(f"no probe folder can be made in {trials_dir} ({why}): {folder_hint(why)}")


_FOLDER_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]{1,128}")
"""One folder name: no separator, no line break, not ``.`` or ``..`` (the whole name must
match: ``fullmatch``)."""


def _count(value: int | None, option: str) -> int | None:
    """A count the user gave (``--gpus``), refused below 1 under its own name."""
    if value is not None and value < 1:
        raise ConfigError(f"{option} {value}: use 1 or more")
    return value


def _per_node(gpus: int | None, nodes: int, here: int) -> int:
    """Ranks on each node: ``gpus`` in all split evenly over the nodes, or every GPU here."""
    _count(gpus, "--gpus")
    if gpus is None:
        return here
    if gpus % nodes:
        raise ConfigError(
            f"--gpus {gpus} does not split evenly over {nodes} nodes: use a multiple of {nodes}"
        )
    return gpus // nodes


def _check_ranks(device: Device, ranks: int, here: int) -> None:
    """More ranks on a node than it can run: GPUs beyond those visible, or CPU ranks beyond
    its cores (a simulated node has as many GPUs as asked; every node is taken to be like
    this one)."""
    if device.kind == "cuda" and ranks > here:
        raise ConfigError(
            f"--gpus {ranks}, but {here} GPU{'s are' if here > 1 else ' is'} visible here "
            f"(CUDA_VISIBLE_DEVICES): use --gpus {here} or fewer, or plan for more with "
            "autotune plan --gpu KEY --gpus N"
        )
    cores = os.cpu_count() or 1
    if device.kind == "cpu" and ranks > cores:
        raise ConfigError(
            f"--gpus {ranks} on the CPU starts {ranks} rank processes, and this machine has "
            f"{cores} cores: use --gpus {cores} or fewer"
        )


def _check_probe_host(model: ModelSpec, spec: ProbeSpec, given: int | None) -> None:
    """Refuse a probe predicted to need more host memory than the node gives the job, as
    ``run`` leaves such configurations out: at its largest size, the offloaded states and
    each rank's process, and on the CPU the emulated device's tensors too (capped by it)."""
    size = max(spec.micro_batch_sizes)
    memory = estimate_memory(
        model, spec.config, micro_batch_size=size, seq_len=spec.seq_len,
        world_size=spec.world_size, cuda_allocator=spec.device == "cuda",
        grad_accum=spec.accumulation(size),
    )  # fmt: skip
    device = memory.device_bytes
    if spec.device_memory_bytes is not None:
        device = min(device, spec.device_memory_bytes)
    need = estimate_host(
        model,
        spec.config,
        world_size=spec.world_size,
        ranks_per_node=spec.num_processes,
        device=spec.device,
        device_bytes=device,
        activation_bytes=memory.offloaded_activation_bytes,
    ).node_bytes
    have = usable_host_bytes(given if given is not None else host_memory_bytes())
    if need > have:
        on_cpu = spec.device == "cpu"
        tensors = ", and on the CPU the device's tensors" if on_cpu else ""
        instead = (
            "a smaller model, a smaller --device-memory or fewer ranks"
            if on_cpu
            else "a configuration that offloads less, or fewer ranks"
        )
        raise NothingFits(
            f"{spec.config.label()} at micro-batch {size} needs {format_bytes(need)} of host "
            f"memory (predicted: offloaded states and each rank's process{tensors}), and this "
            f"node gives the job {format_bytes(have)}: the kernel would kill it; use {instead}, "
            "or --host-memory if the node has more"
        )


def _check_something_fits(
    rows: list[PlanRow], spec: ModelSpec, world: int, capacity: int, *, on_cpu: bool
) -> None:
    """No configuration is predicted to fit: say what the smallest needs, and what to do,
    before a study is made for a search that would probe nothing.

    Raises:
        NothingFits: One line with the smallest configuration's need and what to change.
    """
    if not rows or any(row.fits for row in rows):
        return
    ranks = (
        f"{world} CPU rank{'s' if world > 1 else ''}"
        if on_cpu
        else f"{world} GPU{'s' if world > 1 else ''}"
    )
    each = "rank" if on_cpu else "GPU"
    smallest = min(rows, key=lambda row: row.memory.device_bytes)
    # LoRA, where it was not allowed: the last resort that trains adapters, not the model.
    lora = "" if any(row.config.is_lora for row in rows) else ", or --allow lora"
    if smallest.memory.device_bytes <= capacity:  # the device would do; the host does not
        raise NothingFits(
            f"no configuration of {spec.name} on {ranks} fits this node's host memory (the "
            "offloaded states and each rank's process): use more GPUs or nodes, or a host "
            f"with more memory (--host-memory){lora}"
        )
    needs = format_bytes(smallest.memory.device_bytes)
    more = "a larger --device-memory" if on_cpu else "more GPUs, a larger --device-memory"
    raise NothingFits(
        f"no configuration of {spec.name} on {ranks} fits {format_bytes(capacity)} per {each}: "
        f"the smallest, {smallest.config.label()} at micro-batch {smallest.micro_batch_size}, "
        f"needs {needs} (predicted); use {more}, a shorter --seq-len or a smaller model{lora}"
    )


def tune(
    model: str | None,
    *,
    on_event: Callable[[Event], None] | None = None,
    **options: Any,
) -> RunSummary:
    """Find the fastest configuration that fits: probe, escalate, record every trial.

    Args:
        model: A preset name or a path to a Hugging Face config.json (None: read from a
            Trainer script's ``--model_name_or_path``, with ``script``).
        on_event: Called at each step of the search (a live view, a log).
        **options: As :func:`prepare`: ``budget`` ("30m"), ``seq_len``, ``global_batch``
            (default 8 per GPU), ``gpus``, ``engines``, ``device`` ("auto", "cuda", "cpu" or
            a :class:`~autotune.devices.Device`), ``simulate`` (a GPU key: the estimator's
            simulated GPU), ``device_memory`` (emulated cap per device, needed on the CPU),
            ``headroom``, ``host_memory`` (a node's host memory for the job: default this
            node's; a simulated node's is not limited unless given), ``objective``
            ("tokens" or "mfu"), ``storage`` (an Optuna storage URL), ``trials_dir``,
            ``seed`` (of the simulated device's noise), ``warm`` (real probes: fork ranks from
            a warm process, True; False: each rank a fresh interpreter), ``nodes`` (nodes the
            probes span: default all of the Slurm allocation the run is in, else 1) and
            ``hosts`` (their names, ``"this-host,node2"``, reached by ``ssh``); ``gpus`` is
            then the GPUs in all, split evenly over the nodes. ``script``, ``framework``
            (``hf``, ``accelerate`` or ``torchrun``), ``script_args`` and the script's own
            flags for the knobs (``batch_flag``, ``accum_flag``, ``checkpointing_flag``): probe
            the user's own training script instead of autotune's stand-in (docs/jobs.md).
            ``losses``, ``op_checkpointing``, ``optimizers``, ``activation_offload``: the
            knobs beyond the ladder to search; ``lora_rank``: LoRA allowed at that rank,
            searched once no full fine-tuning configuration is left that may fit (None: not
            allowed).

    Returns:
        Why the search stopped, the best measurement and every measurement of the study.
    """
    return prepare(model, **options).run(on_event)


def tune_jobs(
    path: str | Path,
    *,
    max_age: str | float | None = None,
    on_job: Callable[[Job, Tuning, Freshness], Callable[[Event], None] | None] | None = None,
    on_result: Callable[[JobResult], None] | None = None,
    now: dt.datetime | None = None,
    **defaults: Any,
) -> list[JobResult]:
    """Tune every workload of a job file in turn, each only when something changed.

    A workload is skipped, with the reason, while its study's fingerprint (versions, GPU,
    driver, GPU and node count) is unchanged and holds a configuration that fits, no older
    than ``max_age``. Every workload is checked before the first one runs; one that still
    cannot run (nothing fits, its database is locked) is recorded as failed and the next one
    goes on; Ctrl-C or SIGTERM stops the running probe and the whole job.

    Args:
        path: The job file (YAML, a ``workloads:`` list; see :mod:`autotune.jobs`).
        max_age: Tune again a result older than this (``"7d"``); None: any age stands.
        on_job: Called before a workload is tuned, with its tuning and why; it may return
            the ``on_event`` of that run (a live view).
        on_result: Called with each workload's result as it ends.
        now: The time results are aged against (default: now, the tuner's local time, as
            Optuna stores trial times).
        **defaults: :func:`prepare`'s options (``budget``, ``storage``, ``simulate``, ...),
            for every workload that does not set them.

    Raises:
        ConfigError: When the job file is bad (one line naming file, line and field), or a
            workload's options are ones ``run`` refuses (one line naming file, line and
            workload; every workload is checked as :func:`prepare` checks it, its storage
            and trials folder too, before the first one runs): nothing is run then.
    """
    from autotune.jobs import freshness, read_jobs
    from autotune.study.reader import read_studies

    limit = None if max_age is None else _seconds(max_age, "--max-age")
    jobs = read_jobs(Path(path), defaults)
    for job in jobs:
        model, options = _job_arguments(job)
        try:
            _check(model, **options)
        except ValueError as error:  # ConfigError, or a model that cannot be read
            raise ConfigError(f"{path}:{job.line}: workload {job.index}: {error}") from None
    results = []
    for job in jobs:
        model, options = _job_arguments(job)
        storage = options.get("storage", DEFAULT_STORAGE)
        try:
            studies = read_studies(storage, last=0)
            tuning = prepare(model, **options)
        except NothingFits as error:
            result = JobResult(job=job, status="no fit", why=str(error))
        except (ConfigError, ValueError) as error:
            result = JobResult(job=job, status="failed", why=str(error))
        else:
            fresh = freshness(
                tuning.fingerprint, studies, now=now or dt.datetime.now(), max_age_s=limit
            )
            study = tuning.fingerprint.study_name
            if not fresh.tune:
                tuning.device.close()
                kept = next(s.best for s in studies if s.study_name == study)
                result = JobResult(job=job, status="skipped", why=fresh.why, study=study, best=kept)
            else:
                on_event = on_job(job, tuning, fresh) if on_job is not None else None
                summary = tuning.run(on_event)
                status = (
                    "interrupted"
                    if summary.interrupted
                    else "failed"
                    if summary.failure or summary.mistake
                    else "tuned"
                    if summary.best is not None
                    else "no fit"
                )
                result = JobResult(
                    job=job,
                    status=status,
                    why=summary.stop_reason if summary.failure or summary.mistake else fresh.why,
                    study=study,
                    summary=summary,
                    best=summary.best,
                )
        results.append(result)
        if on_result is not None:
            on_result(result)
        if result.status == "interrupted":
            break
    return results


def _job_arguments(job: Job) -> tuple[str, dict[str, Any]]:
    """A workload's model and :func:`prepare`'s options, from its fields (``run``'s options)."""
    options = dict(job.options)
    model = str(options.pop("model"))
    if "engine" in options:
        options["engines"] = [Engine(name) for name in options.pop("engine").split(",")]
    if "loss" in options:
        options["losses"] = options.pop("loss")
    if "ac_ops" in options:
        options["op_checkpointing"] = options.pop("ac_ops")
    if "act_offload" in options:
        options["activation_offload"] = options.pop("act_offload")
    if "optimizer" in options:
        options["optimizers"] = options.pop("optimizer")
    if "args" in options:
        options["script_args"] = options.pop("args")
    return model, options


def _studies(
    storage: str, model: str | None, gpu: str | None, last: int | None, with_best: bool = True
) -> list[StudyResult]:
    from autotune.study.reader import read_studies

    stores = read_studies(storage, last=last, best=with_best)
    if model:
        # A path names its study by the folder that holds the config, as `run` does.
        name = model if model in {s.fingerprint.model for s in stores} else None
        if name is None:
            try:
                name = resolve_model(model).name
            except ValueError:
                name = model
        stores = [s for s in stores if s.fingerprint.model == name]
    if gpu:
        stores = [s for s in stores if s.fingerprint.gpu == gpu.lower()]
    if not stores:
        raise ConfigError(f"no autotune study in {masked(storage)} matches: run autotune run first")
    return stores


def best(
    *,
    model: str | None = None,
    gpu: str | None = None,
    storage: str = DEFAULT_STORAGE,
    last: int | None = None,
) -> list[StudyResult]:
    """The best configuration of each matching study (what a training launcher reads).

    Args:
        last: Decode only each study's last ``last`` trials into ``measurements`` (0: none,
            the fastest read of the best); None: every trial. ``best`` and ``trial_count``
            are over every trial either way.

    Raises:
        ConfigError: When no study matches.
    """
    return _studies(storage, model, gpu, last)


def trials(
    *,
    model: str | None = None,
    gpu: str | None = None,
    storage: str = DEFAULT_STORAGE,
    last: int | None = None,
    best: bool = True,
) -> list[StudyResult]:
    """Every trial of each matching study, or its ``last`` trials by number.

    Args:
        best: Fill in each study's ``best`` too, over every trial (else it is None, and a
            read of the last trials of a large study is faster).
    """
    return _studies(storage, model, gpu, last, best)


def probe(
    model: str | None,
    config: TrainConfig | None = None,
    *,
    micro_batch_sizes: Iterable[int] = (1,),
    seq_len: int | None = None,
    grad_accum: int = 1,
    gpus: int | None = None,
    device: str | Device = "auto",
    device_memory: str | int | None = None,
    warmup_steps: int = 2,
    timed_steps: int = 3,
    timeout: str | float = "10m",
    trials_dir: str | Path = "trials",
    folder: str = "probes",
    on_start: Callable[[ProbeSpec, Path], None] | None = None,
    set_up: Callable[[SetupStep], SetupResult] | None = None,
    nodes: int | None = None,
    hosts: str | Sequence[str] | None = None,
    host_memory: str | int | None = None,
    script: str | Path | None = None,
    framework: str | None = None,
    script_args: Sequence[str] = (),
    batch_flag: str | None = None,
    accum_flag: str | None = None,
    checkpointing_flag: str | None = None,
    rlhf: RLHFProbe | None = None,
) -> ProbeResult:
    """Run a few real training steps of one configuration at each micro-batch size.

    Args:
        model: A preset name or a path to a Hugging Face config.json.
        config: The configuration (default: one process, bf16 mixed precision).
        micro_batch_sizes: Sizes to measure in one process, in this order.
        gpus: Ranks in all; default all GPUs here (on each node) for a distributed engine,
            else 1.
        device: ``auto``, ``cuda``, ``cpu`` or a :class:`~autotune.devices.Device`.
        device_memory: Emulated device-memory cap per rank (``"20GiB"``).
        timeout: Wall-clock limit of the whole probe.
        trials_dir: Where the probe folder goes: a new ``trials_dir/folder/N``, made once
            the probe is known to be valid.
        on_start: Called with the spec and the folder just before the probe starts.
        set_up: Runs each of the device's set-up steps (building DeepSpeed ops the probe
            loads that are not built), before the probe and outside its timeout; default:
            ``step.run()``. A live view wraps it in a spinner and prints its result.
        nodes: Nodes the probe spans (default: all of the Slurm allocation it runs in,
            else 1); ``gpus`` is split evenly over them.
        hosts: The nodes' names (``"this-host,node2"``), this one first; others are
            reached by ``ssh``.
        host_memory: Host memory of a node for the job (``"125GiB"``); default: what this
            node gives it. A probe predicted to need more is refused before it starts (the
            kernel's OOM killer would end it as ``host_oom``, minutes later).
        script, framework, script_args, batch_flag, accum_flag, checkpointing_flag: Probe the
            user's own training script
            (as :func:`tune` does), each size a run of its own.
        rlhf: Each step an RL iteration instead (``model`` the policy): the other models
            built beside it, the rollout engine's share held as allocated memory (an
            emulated reservation), scoring forwards, then the trained models' steps; each
            phase's peak in the result (:mod:`autotune.probe.rlhf`).

    Raises:
        NothingFits: The probe is predicted to need more host memory than the node has.
    """
    job = _script_job(
        script,
        framework,
        script_args,
        (batch_flag, accum_flag, checkpointing_flag),
        simulate=None,
        device=device,
    )
    if job is not None:
        model = model or _script_model(job)
        check_engines(job, [(config or TrainConfig()).engine])
        _stand_in_only(job, config or TrainConfig())
        if (nodes or 1) > 1 or hosts:
            raise ConfigError("--script runs on one node: leave out --nodes and --hosts")
    if model is None:
        raise ConfigError("give --model: a preset name or the path of a config.json")
    shape = resolve_model(model)  # fails fast on an unknown name
    seq_len = _seq_len(shape, seq_len)
    config = config or TrainConfig()
    if config.ac_every > shape.num_layers:
        raise ConfigError(
            f"checkpointing every {config.ac_every} blocks of {shape.name}'s "
            f"{shape.num_layers} checkpoints only its first block: use --ac every-"
            f"{shape.num_layers} or less"
        )
    if _FOLDER_NAME.fullmatch(folder) is None:
        raise ConfigError(
            f"--study {folder!r} is not a folder name: use letters, digits, '.', '_' or '-' "
            "(it is made under --trials-dir, never elsewhere)"
        )
    _count(gpus, "--gpus")
    layout = _nodes(nodes, hosts, simulated=not isinstance(device, str))
    count = layout.count if layout is not None else 1
    if isinstance(device, str):
        detected = detect_gpus()
        if device == "cuda" and detected is None:
            raise ConfigError("--device cuda, but no GPU is visible: use --device cpu")
        if device == "auto":
            device = "cuda" if detected else "cpu"
        if device not in DEVICES:
            raise ConfigError(f"unknown device {device!r}: use {', '.join(DEVICES)}")
        # One probe: nothing to share with warm workers.
        chosen: Device = LocalDevice(device, warm=False, nodes=layout)
        here = detected.count if detected and device == "cuda" else 1
    else:
        chosen, here = device, 1
    if job is None:
        _knobs(None, (config.loss,), False, (config.optimizer,), chosen.kind)  # where it runs
        _check_attention(config.attention, chosen.kind)  # the precision: TrainConfig's check
        if config.is_lora:
            _need_peft("--lora-rank", chosen.kind)
    single = config.engine is Engine.SINGLE and count == 1
    spec = ProbeSpec(
        model=model,
        config=config,
        micro_batch_sizes=tuple(micro_batch_sizes),
        seq_len=seq_len,
        grad_accum=grad_accum,
        num_processes=1 if single and gpus is None else _per_node(gpus, count, here),
        nodes=count,
        device=chosen.kind if chosen.kind in ("cuda", "cpu") else "cuda",
        device_memory_bytes=_bytes(device_memory, "--device-memory"),
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        timeout_s=_seconds(timeout, "the probe timeout"),
        script=job,
        rlhf=rlhf,
    )
    if rlhf is not None:
        _check_rlhf_probe(shape, rlhf, spec)
    if isinstance(chosen, LocalDevice):
        _check_probe_host(shape, spec, _bytes(host_memory, "--host-memory"))
    for step in chosen.setup(spec):
        if set_up is None:
            step.run()
        else:
            set_up(step)
    probe_dir = new_probe_dir(Path(trials_dir), folder)
    if on_start is not None:
        on_start(spec, probe_dir)
    return chosen.launch(spec, probe_dir)


def _check_rlhf_probe(policy: ModelSpec, rlhf: RLHFProbe, spec: ProbeSpec) -> None:
    """Refuse, in one line, an RL iteration a probe cannot make: models that cannot pair
    (:func:`autotune.rlhf.check_models`), or a CPU probe without a cap to take a share of."""
    check_models(
        rlhf.algorithm,
        RLHFModels(
            policy=policy,
            reference=_role_model(rlhf.reference, None),
            critic=_role_model(rlhf.critic, None),
            reward=_role_model(rlhf.reward, None),
        ),
    )
    if spec.device == "cpu" and spec.device_memory_bytes is None:
        raise ConfigError(RLHF_CPU_NEEDS_A_CAP)


@dataclass(frozen=True, kw_only=True)
class Export:
    """A measured configuration in a trainer's format: the text, and what it was made of."""

    study: str
    """The study's name."""
    measurement: Measurement
    """The trial exported (the best point's latest trial, pooled, unless one was named)."""
    launch: Launch
    format: Format
    text: str
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the format cannot carry of the configuration, and what to do instead."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "study": self.study,
            "trial": self.measurement.number,
            "format": self.format.value,
            "model": self.launch.model,
            "config": self.launch.config.to_dict(),
            "label": self.launch.config.label(),
            "micro_batch_size": self.launch.micro_batch_size,
            "grad_accum": self.launch.grad_accum,
            "world_size": self.launch.world_size,
            "nodes": self.launch.nodes,
            "seq_len": self.launch.seq_len,
            "global_batch": self.launch.global_batch,
            "text": self.text,
            "notes": list(self.notes),
        }


def export(
    format: Format | str,
    *,
    model: str | None = None,
    gpu: str | None = None,
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
    trial: int | None = None,
    engine: Engine | str | None = None,
) -> Export:
    """The best configuration of the matching study, as a trainer's own configuration.

    Args:
        format: ``deepspeed``, ``accelerate``, ``hf``, ``torchrun`` or ``fsdp`` (see
            :class:`~autotune.launch.Format`).
        model: Only studies of this model (a preset name, or the path its study was run
            with: the model's shape is read from it).
        gpu: Only studies on this GPU key.
        study: The study's name, where several match.
        trial: Export this trial (by number) instead of the best; it must have fit.
        engine: Export the best configuration of this engine (``deepspeed`` for a DeepSpeed
            JSON where the study's best is FSDP, say).

    Raises:
        ConfigError: When the format is unknown or cannot express the configuration, when no
            study or several match, when the trial is missing or did not fit, or when no
            configuration of the engine fits.
    """
    try:
        chosen = Format(format)
    except ValueError:
        choices = ", ".join(f.value for f in Format)
        raise ConfigError(f"unknown export format {format!r}: use one of {choices}") from None
    if trial is not None and engine is not None:
        raise ConfigError("--trial and --engine: a trial has its engine; give one of them")
    wanted = parse_choice(Engine, engine, "engine")
    found = _one_study(storage, model, gpu, study, 0 if trial is None and wanted is None else None)
    if wanted is not None:
        measurement = best_point([m for m in found.measurements if m.config.engine is wanted])
        if measurement is None:
            raise ConfigError(
                f"no {wanted.value} configuration of {found.study_name} fits yet: autotune "
                "trials lists what was measured"
            )
    else:
        measurement = found.best if trial is None else _trial(found, trial)
    if measurement is None:
        raise ConfigError(
            f"no configuration of {found.study_name} fits yet: run autotune run, or pick a "
            "trial with --trial N"
        )
    launch = _launch(found, measurement, _model_of(found.fingerprint.model, model))
    text = _render(found, launch, chosen)
    return Export(
        study=found.study_name,
        measurement=measurement,
        launch=launch,
        format=chosen,
        text=text,
        notes=knob_notes(launch, chosen) + value_notes(launch, chosen),
    )


def _render(found: StudyResult, launch: Launch, fmt: Format) -> str:
    """A study's configuration in ``fmt``; ``command``: the study's own script, run with it."""
    script = found.fingerprint.script
    if fmt is not Format.COMMAND or script is None:
        return render(launch, fmt)
    command = job_command(  # its secrets read from variables the user sets
        ScriptJob.from_dict(script).for_shell(), launch, cpu=found.fingerprint.device == "cpu"
    )
    return shell_text(command, launch, launch.summary())


def _one_study(
    storage: str, model: str | None, gpu: str | None, study: str | None, last: int | None
) -> StudyResult:
    """The one study that matches (by model, GPU and name), as ``export`` and ``report``
    select it."""
    studies = _studies(storage, model, gpu, last)
    if study is not None:
        studies = [s for s in studies if s.study_name == study]
        if not studies:
            raise ConfigError(
                f"no study named {study!r} matches in {masked(storage)}: autotune best lists them"
            )
    if len(studies) > 1:
        names = ", ".join(s.study_name for s in studies)
        raise ConfigError(f"{len(studies)} studies match ({names}): pick one with --study NAME")
    return studies[0]


def _launch(found: StudyResult, measurement: Measurement, spec: ModelSpec) -> Launch:
    """How to launch a measured configuration of a study."""
    fingerprint = found.fingerprint
    return Launch(
        model=fingerprint.model,
        hidden_size=spec.hidden_size,
        config=measurement.config,
        micro_batch_size=measurement.micro_batch_size,
        grad_accum=measurement.grad_accum
        or fingerprint.workload.grad_accum(measurement.micro_batch_size),
        world_size=fingerprint.gpus,
        nodes=fingerprint.nodes,
        seq_len=fingerprint.seq_len,
        transformers=fingerprint.software.get("transformers"),
        simulated=measurement.simulated or fingerprint.device == "simulated",
    )


@dataclass(frozen=True, kw_only=True)
class Report:
    """An HTML report written: where, and of which study."""

    path: Path
    study: str
    """The study's name."""

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "study": self.study}


def write_report(
    output: str | Path,
    *,
    model: str | None = None,
    gpu: str | None = None,
    study: str | None = None,
    storage: str = DEFAULT_STORAGE,
    budget: str | float | None = None,
    force: bool = False,
) -> Report:
    """Write the matching study as one self-contained HTML page (works offline): memory per
    GPU of each configuration (predicted breakdown and measured peak), tokens/s and MFU
    against micro-batch, the search's path, the best configuration with its launch, and
    every probe with a link to its folder.

    Args:
        output: The HTML file to write.
        model: Only studies of this model (a preset name, or the path its study was run
            with).
        gpu: Only studies on this GPU key.
        study: The study's name, where several match.
        budget: The search's budget (``"30m"``), drawn on the search's chart.
        force: Overwrite ``output`` if it exists.

    Raises:
        ConfigError: When no study or several match, ``output`` exists without ``force``,
            or it cannot be written.
    """
    from autotune.report.html import read_trial_times, render_html

    path = Path(output)
    check_output(path, force=force)
    budget_s = None if budget is None else _seconds(budget, "the budget")
    found = _one_study(storage, model, gpu, study, None)
    spec = _model_of(found.fingerprint.model, model)
    launches: dict[str, str] = {}
    if found.best is not None:
        launch = _launch(found, found.best, spec)
        for fmt in Format:
            try:
                launches[fmt.value] = _render(found, launch, fmt)
            except ConfigError:
                continue  # a format that cannot express this engine
    text = render_html(
        found,
        model=spec,
        launches=launches,
        times=read_trial_times(storage, found.study_name),
        budget_s=budget_s,
    )
    write_new_file(path, text, force=force)
    return Report(path=path, study=found.study_name)


def _trial(found: StudyResult, number: int) -> Measurement:
    """Trial ``number`` of a study, which must have fit."""
    match = next((m for m in found.measurements if m.number == number), None)
    if match is None:
        raise ConfigError(
            f"{found.study_name} has no trial {number}: autotune trials lists its trials"
        )
    if not match.feasible:
        raise ConfigError(
            f"trial {number} of {found.study_name} did not fit ({match.outcome or match.state}): "
            "export a trial that fit, or the best without --trial"
        )
    return match


def _model_of(name: str, given: str | None) -> ModelSpec:
    """The shape of a study's model: from the path it was run with, else its preset."""
    for candidate in (given, name):
        if candidate is None:
            continue
        try:
            return resolve_model(candidate)
        except ValueError:
            continue
    raise ConfigError(
        f"the study's model {name!r} is not a preset: pass --model path/to/config.json, the "
        "config it was run with"
    )
