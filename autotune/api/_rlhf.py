"""RLHF: plan, tune and export an RL iteration's roles (policy, reference, reward, critic)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import ConfigError, Engine, Precision
from autotune.devices import LocalDevice
from autotune.estimator.plan import DEVICE_RESERVE_BYTES
from autotune.estimator.rlhf import RLHFRow
from autotune.estimator.rlhf import plan_rlhf as rlhf_rows
from autotune.handoff.rlhf import RLFormat, RLHFLaunch, render_rlhf
from autotune.hardware import GpuSpec, cpu_device_spec, detect_gpus
from autotune.models import ModelSpec, resolve_model
from autotune.probe.launcher import new_probe_dir
from autotune.probe.spec import ProbeSpec
from autotune.study.fingerprint import DEFAULT_STORAGE
from autotune.tuned.rlhf import (
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
from autotune.urls import masked
from autotune.values import (
    count_value,
    positive_seconds,
    reserve_bytes,
    seq_len_for,
    size_bytes,
    target_gpu,
)

if TYPE_CHECKING:
    from autotune.search.rlhf import RLHFSummary
    from autotune.study.rlhf import RLHFStudy, RLHFTrial


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


def role_model_spec(value: str | ModelSpec | None, default: ModelSpec | None) -> ModelSpec | None:
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
            default: every share of :data:`autotune.tuned.rlhf.SHARES`.
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
    target, here = target_gpu(gpu)
    world = count_value(gpus, "--gpus") or here
    length = seq_len_for(policy, seq_len)
    models = RLHFModels(
        policy=policy,
        reference=role_model_spec(reference, policy),
        critic=role_model_spec(critic, policy if algo is Algorithm.PPO else None),
        reward=role_model_spec(reward, policy),
    )
    work = RLHFWorkload(
        algorithm=algo,
        models=models,
        seq_len=length,
        response_len=count_value(response_len, "--response-len") or length // 2,
        rollout_batch=count_value(rollout_batch, "--rollout-batch") or 2 * world,
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
        reserve=reserve_bytes(reserve, target),
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
    from autotune.search.rlhf import RLHFSummary
    from autotune.search.rlhf import search as search_rlhf
    from autotune.study.rlhf import RLHFStudy

    world = count_value(gpus, "--gpus") or 1
    if world > 1 and frozen is not None and Placement.OFFLOAD in parse_placements(frozen):
        raise ConfigError(
            "--frozen host is probed on one rank (its weights are not moved to the host in "
            "shards yet): use --frozen gpu with --gpus, or --gpus 1"
        )
    budget_s = positive_seconds(budget, "the budget")
    kind, cap, target = _rlhf_target(device, device_memory)
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
    prober = _IterationProber(
        model=model,
        workload=work,
        names=names,
        world=world,
        device=kind,
        cap=cap,
        timeout_s=max(60.0, budget_s),
        trials_dir=Path(trials_dir),
        study=study,
        on_probe=on_probe,
    )
    started = time.monotonic()
    try:
        trials, made, why = search_rlhf(
            found.rows,
            study.trials(),
            prober,
            budget_left=lambda: budget_s - (time.monotonic() - started),
            cost=lambda row: max(prober.durations, default=0.0),
            max_probes=max_probes,
        )
    finally:
        prober.local.close()
    return RLHFSummary(
        study=study.name, trials=trials, probes=made, stop_reason=why, best=study.best()
    )


def _rlhf_target(device: str, device_memory: str | int | None) -> tuple[str, int | None, GpuSpec]:
    """Where an RL iteration's probes run (``cuda`` or ``cpu``), the memory cap per rank
    (required on the CPU) and the device the planner sizes for."""
    kind = device
    if kind == "auto":
        kind = "cuda" if detect_gpus() else "cpu"
    if kind not in ("cuda", "cpu"):
        raise ConfigError(f"unknown device {device!r}: use cuda, cpu or auto")
    cap = size_bytes(device_memory, "--device-memory")
    if kind == "cpu" and cap is None:
        raise ConfigError(RLHF_CPU_NEEDS_A_CAP)
    target = cpu_device_spec(cap) if kind == "cpu" and cap else target_gpu(None)[0]
    if kind == "cuda" and cap is not None:
        target = dataclasses.replace(target, memory_bytes=cap)
    return kind, cap, target


@dataclass(kw_only=True)
class _IterationProber:
    """Probes one planned layout of an RL iteration on this node and records it as a trial
    of the workload's RLHF study: the search's ``probe`` (:func:`autotune.search.rlhf.search`)."""

    model: str
    workload: RLHFWorkload
    names: dict[str, str | None]
    world: int
    device: str
    cap: int | None
    timeout_s: float
    trials_dir: Path
    study: RLHFStudy
    on_probe: Callable[[RLHFTrial, RLHFRow, RLHFTrial | None], None] | None
    durations: list[float] = dataclasses.field(default_factory=list)
    local: LocalDevice = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.local = LocalDevice(self.device, warm=False)

    def spec(self, row: RLHFRow) -> ProbeSpec:
        """The probe of ``row``: one timed iteration with the engine's share held."""
        work = self.workload
        return ProbeSpec(
            model=self.model,
            config=row.config,
            micro_batch_sizes=(row.micro_batch_size,),
            seq_len=work.seq_len,
            grad_accum=row.grad_accum,
            num_processes=self.world,
            device=self.device,
            device_memory_bytes=self.cap,
            warmup_steps=1,
            timed_steps=1,
            timeout_s=self.timeout_s,
            rlhf=RLHFProbe(
                algorithm=work.algorithm,
                reference=self.names["reference"],
                critic=self.names["critic"],
                reward=self.names["reward"],
                share=row.share,
                sleep=row.sleep,
                frozen=row.frozen,
            ),
        )

    def __call__(self, row: RLHFRow) -> RLHFTrial:
        from autotune.search.rlhf import measured_speed
        from autotune.study.rlhf import RLHFTrial

        spec = self.spec(row)
        for step in self.local.setup(spec):
            step.run()
        began = time.monotonic()
        result = self.local.launch(spec, new_probe_dir(self.trials_dir, "rlhf"))
        self.durations.append(time.monotonic() - began)
        size = result.sizes[0] if result.sizes else None
        outcome = size.outcome.value if size is not None else result.outcome.value
        phases = size.extra.get("rlhf", {}) if size is not None else {}
        speed = 0.0
        if size is not None and size.outcome.value == "ok" and phases:
            speed = measured_speed(row, phases["phase_s"], emulated=True)
        trial = self.study.record(
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
        if self.on_probe is not None:
            self.on_probe(trial, row, self.study.best())
        return trial


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


def check_rlhf_probe(policy: ModelSpec, rlhf: RLHFProbe, spec: ProbeSpec) -> None:
    """Refuse, in one line, an RL iteration a probe cannot make: models that cannot pair
    (:func:`autotune.tuned.rlhf.check_models`), or a CPU probe without a cap to take a share of."""
    check_models(
        rlhf.algorithm,
        RLHFModels(
            policy=policy,
            reference=role_model_spec(rlhf.reference, None),
            critic=role_model_spec(rlhf.critic, None),
            reward=role_model_spec(rlhf.reward, None),
        ),
    )
    if spec.device == "cpu" and spec.device_memory_bytes is None:
        raise ConfigError(RLHF_CPU_NEEDS_A_CAP)
