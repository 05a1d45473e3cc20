"""What one probe is asked to do: a configuration, a workload and how to measure it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from autotune.config import ConfigError, Engine, Precision, TrainConfig
from autotune.layouts import pipeline_microbatches_ok
from autotune.tuned.rlhf import Placement, RLHFProbe
from autotune.tuned.script import ScriptJob

__all__ = ["MAX_PROBE_ACCUMULATION", "ProbeSpec", "ProbeTemplate", "layout_refusal"]

MAX_PROBE_ACCUMULATION = 2
"""Micro-steps per optimizer step of a probe, at most: from the second one on, the gradients
of the one before are alive through its forward (and, where the engine skips the reduction
until the last micro-step, kept unreduced: FSDP2 keeps each block's whole gradient), which is
the peak of training with accumulation; more micro-steps add time, not memory."""


def layout_refusal(config: TrainConfig, world_size: int) -> str | None:
    """Why a probe of ``world_size`` ranks cannot run ``config``'s layout yet (one line, what
    to do), or None: context parallelism needs a GPU's attention kernels; a pipeline is probed
    as one over all the ranks, without TP; TP's groups must divide the ranks, under FSDP2
    (DDP does not wrap a tensor-parallel model)."""
    if config.cp > 1:
        return (
            f"{config.label()}: context parallel layouts are planned (autotune plan), not "
            "probed yet (torch runs them on a GPU's attention kernels): probe --tp or --pp"
        )
    if config.pp > 1 and (config.tp > 1 or world_size != config.pp):
        return (
            f"--pp {config.pp} probes one pipeline over all its ranks yet: use --gpus "
            f"{config.pp}, without --tp"
        )
    if config.tp > 1 and world_size % config.tp:
        return (
            f"--tp {config.tp} does not divide {world_size} ranks: use --gpus a multiple of "
            f"{config.tp}"
        )
    if config.tp > 1 and config.engine is Engine.DDP:
        return (
            "--tp probes FSDP2 over the data-parallel ranks (DDP does not wrap a "
            "tensor-parallel model): use --engine fsdp with --tp"
        )
    return None


MAX_GRAD_ACCUM = 1 << 16
"""The most micro-steps a probe's optimizer step takes (65,536): published global batches are
thousands of sequences (4M tokens of 4,096 is 1,024 micro-steps of one sequence on one GPU),
and a probe runs its warm-up and timed steps whole."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeSpec:
    """One probe: a configuration measured at one or more micro-batch sizes in one process group.

    Sizes are run in the order given. After an OOM a single-process probe recovers and goes on
    with the sizes smaller than the one that failed; a multi-process probe stops, because the
    other ranks may be blocked in a collective the failed rank will never join.
    """

    model: str
    """Preset name or path to a Hugging Face config.json."""
    config: TrainConfig = field(default_factory=TrainConfig)
    """Engine, sharding, precision, checkpointing, offload, attention."""
    micro_batch_sizes: tuple[int, ...] = (1,)
    """Sequences per rank per micro-step, measured in this order."""
    seq_len: int = 2048
    """Tokens per sequence (the user's recipe; never changed by the tuner)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step during the probe where no global batch says
    (:meth:`accumulation`)."""
    num_processes: int = 1
    """Ranks per node (the data-parallel world size on one node)."""
    nodes: int = 1
    """Nodes the ranks span, ``num_processes`` on each (the device says which hosts)."""
    device: str = "auto"
    """``cuda``, ``cpu`` or ``auto`` (cuda when a GPU is visible)."""
    device_memory_bytes: int | None = None
    """Emulated device-memory cap per rank; None for the whole device."""
    warmup_steps: int = 2
    """Optimizer steps run before the timed window (allocator warm-up, lazy init, autotuning)."""
    timed_steps: int = 3
    """Optimizer steps in the timed window."""
    timeout_s: float = 600.0
    """Wall-clock limit for the whole probe, start-up included; the process group is killed."""
    seed: int = 0
    """Seed of the synthetic batches and the random weights (the search gives a point's n-th
    re-measurement seed n, an independent sample)."""
    lr: float = 1e-4
    """AdamW learning rate (probes only need a finite, falling loss)."""
    script: ScriptJob | None = None
    """The user's training job to run instead of autotune's stand-in (each micro-batch size
    a run of its own); None: the stand-in."""
    global_batch: int | None = None
    """The workload's global batch (sequences): each size accumulates as training does at it,
    up to :data:`MAX_PROBE_ACCUMULATION` micro-steps (:meth:`accumulation`); None: every size
    at ``grad_accum``."""
    rlhf: RLHFProbe | None = None
    """An RL iteration instead of a training step: the other models and the rollout engine's
    reservation (``autotune/probe/rlhf.py``); None: training alone."""

    def __post_init__(self) -> None:
        if isinstance(self.config, dict):
            object.__setattr__(self, "config", TrainConfig.from_dict(self.config))
        if isinstance(self.script, dict):
            object.__setattr__(self, "script", ScriptJob.from_dict(self.script))
        if isinstance(self.rlhf, dict):
            object.__setattr__(self, "rlhf", RLHFProbe.from_dict(self.rlhf))
        object.__setattr__(self, "micro_batch_sizes", tuple(self.micro_batch_sizes))
        if not self.micro_batch_sizes or any(m < 1 for m in self.micro_batch_sizes):
            raise ConfigError("micro-batch sizes must be positive integers, e.g. --micro-batch 4")
        for name in ("seq_len", "grad_accum", "num_processes", "nodes", "timed_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1")
        if self.grad_accum > MAX_GRAD_ACCUM:
            raise ConfigError(
                f"--grad-accum {self.grad_accum:,} micro-steps a step: a probe runs at most "
                f"{MAX_GRAD_ACCUM:,} (16 times the accumulation of the largest published global "
                "batch on one GPU); use fewer"
            )
        if self.warmup_steps < 0:
            raise ConfigError("warmup-steps must be 0 or more")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"unknown device {self.device!r}: use cuda, cpu or auto")
        layout = self.config
        refusal = layout_refusal(layout, self.world_size)
        if refusal is not None:
            raise ConfigError(refusal)
        if layout.pp > 1 and self.script is None and self.rlhf is None:
            for size in self.micro_batch_sizes:
                if not pipeline_microbatches_ok(layout, self.accumulation(size)):
                    raise ConfigError(
                        f"--pp {layout.pp} ({layout.pp_schedule.value}) needs at least "
                        f"{layout.pp} microbatches a step"
                        + (", a multiple of it" if layout.pp_virtual > 1 else "")
                        + f": use --grad-accum {2 * layout.pp}"
                    )
        if layout.is_layout and (self.script is not None or self.rlhf is not None):
            raise ConfigError(
                "--tp and --pp probe autotune's stand-in training step: leave out --script "
                "and --rlhf"
            )
        if layout.engine is Engine.SINGLE and self.world_size != layout.model_parallel:
            raise ConfigError(
                f"engine single runs one process, not {self.world_size}: "
                "use --engine ddp, fsdp or deepspeed for several"
            )
        if (
            self.device == "cpu"
            and self.config.engine is Engine.DEEPSPEED
            and self.config.precision is Precision.FP16_MIXED
        ):
            raise ConfigError(
                "DeepSpeed's CPU accelerator has no fp16: use --precision bf16-mixed on the CPU"
            )
        if self.device_memory_bytes is not None and self.device_memory_bytes <= 0:
            raise ConfigError("--device-memory must be a positive size, like 20GiB")
        if self.timeout_s <= 0:
            raise ConfigError("the probe timeout must be positive, like 10m")
        if self.rlhf is not None:
            if self.world_size != 1 and self.rlhf.frozen is Placement.OFFLOAD:
                raise ConfigError(
                    "--frozen host is probed on one rank (its weights are not moved to the host "
                    "in shards yet): use --frozen gpu with several ranks, or --gpus 1"
                )
            if self.nodes != 1:
                raise ConfigError("a probe of an RL iteration runs on one node: leave out --nodes")
            if self.script is not None:
                raise ConfigError(
                    "--rlhf probes autotune's stand-in models; your script builds its own: "
                    "leave out --script with --rlhf"
                )

    @property
    def world_size(self) -> int:
        """Ranks in all: ``num_processes`` on each of ``nodes``."""
        return self.num_processes * self.nodes

    def accumulation(self, micro_batch_size: int) -> int:
        """Micro-steps per optimizer step the probe runs at ``micro_batch_size``: as training
        accumulates at that size (the global batch over the size and the ranks), up to
        :data:`MAX_PROBE_ACCUMULATION` (a pipeline runs all of its step's microbatches: its
        schedule's memory and bubble depend on them); ``grad_accum`` without a global batch,
        and for an RL iteration (whose micro-steps are its own)."""
        if self.global_batch is None or self.rlhf is not None:
            return self.grad_accum
        ranks = self.world_size // self.config.model_parallel  # the data-parallel ones
        steps = self.global_batch // (micro_batch_size * ranks)
        return max(1, steps if self.config.pp > 1 else min(MAX_PROBE_ACCUMULATION, steps))

    @property
    def tokens_per_micro_step(self) -> int:
        """Tokens one rank processes per micro-step, at the first size."""
        return self.micro_batch_sizes[0] * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (written as config.json in the probe's folder)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["config"] = self.config.to_dict()
        data["micro_batch_sizes"] = list(self.micro_batch_sizes)
        data["script"] = None if self.script is None else self.script.to_dict()
        data["rlhf"] = None if self.rlhf is None else self.rlhf.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeSpec:
        """Inverse of :meth:`to_dict`."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeTemplate:
    """What every probe of one tuning run shares: the model, the workload's sequence length and
    ranks, the device and how to measure. The search fills in the rest per probe."""

    model: str
    """Preset name or path to a Hugging Face config.json, as the ranks will resolve it."""
    seq_len: int
    num_processes: int
    """Ranks per node."""
    nodes: int = 1
    device: str = "auto"
    device_memory_bytes: int | None = None
    warmup_steps: int = 2
    timed_steps: int = 3
    script: ScriptJob | None = None
    """The user's training job, or None for autotune's stand-in."""
    global_batch: int | None = None

    def spec(
        self,
        config: TrainConfig,
        micro_batch_sizes: tuple[int, ...],
        *,
        timeout_s: float,
        seed: int = 0,
    ) -> ProbeSpec:
        """The probe of ``config`` at ``micro_batch_sizes`` (validated as any ProbeSpec)."""
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ProbeSpec(
            **shared,
            config=config,
            micro_batch_sizes=micro_batch_sizes,
            timeout_s=timeout_s,
            seed=seed,
        )
