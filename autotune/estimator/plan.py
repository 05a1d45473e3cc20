"""Rank every configuration of the space by predicted throughput, without a GPU.

For each configuration the planner predicts peak memory and step time at every micro-batch that
reaches the global batch exactly, and keeps the fastest size that fits the GPU's memory (every
size's prediction stays on the row for the search). Configurations that fit at no size are
listed after, with how much they miss by at micro-batch 1.

The knobs that trade time (or the moments' precision) for memory are kept only where they
pay: a configuration with the chunked loss, op-level checkpointing or 8-bit AdamW is dropped
when the same configuration without it fits as large a micro-batch (it would only be slower:
one more forward of the output layer, the cheap ops of each block run again, a step that
quantizes), so they appear on the rows where what they save allows a larger micro-batch or
any fit at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune.config import (
    KNOB_OFF,
    PLANNED_KNOBS,
    Attention,
    Engine,
    Knobs,
    Loss,
    Precision,
    TrainConfig,
)
from autotune.estimator.host import HOST_RESERVE_BYTES, HostEstimate, estimate_host
from autotune.estimator.memory import MemoryEstimate, estimate_memory
from autotune.estimator.timing import StepTime, predict_step_time
from autotune.hardware import GpuSpec
from autotune.models import ModelSpec
from autotune.space import Workload, configurations, micro_batch_options
from autotune.units import format_bytes

__all__ = [
    "DEVICE_RESERVE_BYTES",
    "PlanRow",
    "caching_allocator",
    "default_precision",
    "plan",
    "point_estimates",
    "usable_bytes",
]

DEVICE_RESERVE_BYTES = 1280 * 1024**2
"""Device memory the caching allocator of one rank cannot get, 1.25 GiB. Measured on an H100
80GB HBM3 (measurements/h100-2026-11-23, docs/estimator.md): of the driver's 79.65 GiB total,
CUDA reports 79.18 GiB (0.47 GiB kept by the driver), and a process's own non-PyTorch memory
(CUDA context, cuBLAS workspaces) took 0.74 GiB: 1.21 GiB. FSDP2's and DeepSpeed's processes
took 0.55 and 0.93 GiB more at one rank (NCCL communicators, DeepSpeed's buffers), which no
estimate counts yet. The allocator's unusable free blocks are part of each estimate instead
(``MemoryEstimate.allocator_bytes``). ``--reserve`` overrides it."""


def caching_allocator(gpu: GpuSpec) -> bool:
    """Whether estimates for ``gpu`` carry the CUDA caching allocator's share: every GPU, not
    the CPU's emulated device (``cpu_device_spec``), whose tensors are counted exactly."""
    return gpu.key != "cpu"


def usable_bytes(
    gpu: GpuSpec, *, reserve: int = DEVICE_RESERVE_BYTES, headroom: float = 0.0
) -> int:
    """Bytes one GPU's caching allocator can hold: its memory less the reserve, less headroom.

    A configuration fits where its ``MemoryEstimate.device_bytes`` (live tensors and the
    allocator's unusable blocks) are at most this.

    Args:
        gpu: The GPU.
        reserve: Bytes kept for the driver and the CUDA context (see DEVICE_RESERVE_BYTES).
        headroom: Fraction of the memory a fitting configuration must leave free (0.1 = 10%).
    """
    return int((gpu.memory_bytes - reserve) * (1.0 - headroom))


def default_precision(gpu: GpuSpec) -> Precision:
    """bf16 mixed precision where the GPU has bf16, else fp16 with loss scaling (V100)."""
    return Precision.BF16_MIXED if gpu.peak("bf16") else Precision.FP16_MIXED


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRow:
    """One configuration at its best micro-batch, or at micro-batch 1 when nothing fits."""

    config: TrainConfig
    micro_batch_size: int
    grad_accum: int
    memory: MemoryEstimate
    capacity_bytes: int
    time: StepTime | None
    """Predicted step time; None when the configuration does not fit."""
    peaks: Mapping[int, int] = field(default_factory=dict)
    """Predicted peak device bytes (``MemoryEstimate.device_bytes``) at every micro-batch of
    the workload, fitting or not."""
    speeds: Mapping[int, float] = field(default_factory=dict)
    """Predicted tokens/s at every micro-batch of the workload, fitting or not (the search
    weighs the sizes that may fit where the memory prediction may be off)."""
    mfus: Mapping[int, float] = field(default_factory=dict)
    """Predicted MFU at every micro-batch of the workload (empty without a peak FLOP/s)."""
    host: HostEstimate | None = None
    """Predicted host memory of a node (offloaded states, each rank's process)."""
    host_capacity_bytes: int | None = None
    """Host memory a node's ranks may take; None when the host is not checked."""
    twin: TrainConfig | None = None
    """Set on a row the planner leaves out (``plan(planned_out=True)`` lists it last): the
    same configuration without one of its knobs, predicted to fit as large a micro-batch.
    The search tries the row once that twin runs out of memory where it was predicted to fit."""

    def peak_at(self, micro_batch_size: int) -> float:
        """Predicted peak bytes at a micro-batch (between listed sizes: linear in it)."""
        if micro_batch_size in self.peaks:
            return self.peaks[micro_batch_size]
        slope = self.memory.activation_bytes_per_sample
        return self.memory.device_bytes + slope * (micro_batch_size - self.micro_batch_size)

    @property
    def fits(self) -> bool:
        """Fits the device at its micro-batch (the allocator's share included), and the host."""
        return self.memory.device_bytes <= self.capacity_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        if self.host is None or self.host_capacity_bytes is None:
            return True
        return self.host.node_bytes <= self.host_capacity_bytes

    @property
    def over_bytes(self) -> int:
        """How far the device peak exceeds the capacity (0 when it fits)."""
        return max(0, self.memory.device_bytes - self.capacity_bytes)

    @property
    def miss(self) -> str | None:
        """Why the configuration does not fit, in a few words; None when it fits."""
        if not self.host_fits:
            assert self.host is not None and self.host_capacity_bytes is not None
            return (
                f"host: needs {format_bytes(self.host.node_bytes)} of "
                f"{format_bytes(self.host_capacity_bytes)}"
            )
        if self.over_bytes:
            return f"{format_bytes(self.over_bytes)} over"
        return None

    @property
    def tokens_per_second(self) -> float:
        return self.time.tokens_per_second if self.time else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.label(),
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "fits": self.fits,
            "over_bytes": self.over_bytes,
            "capacity_bytes": self.capacity_bytes,
            "miss": self.miss,
            "host": None
            if self.host is None
            else {
                "node_bytes": self.host.node_bytes,
                "per_rank_bytes": self.host.per_rank_bytes,
                "states_bytes": self.host.states_bytes,
                "ranks_per_node": self.host.ranks_per_node,
                "capacity_bytes": self.host_capacity_bytes,
                "fits": self.host_fits,
            },
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict() if self.time else None,
        }


def plan(
    model: ModelSpec,
    gpu: GpuSpec,
    workload: Workload,
    *,
    engines: Iterable[Engine] | None = None,
    precision: Precision | None = None,
    attention: Attention = Attention.SDPA,
    gpus_per_node: int = 8,
    reserve: int = DEVICE_RESERVE_BYTES,
    headroom: float = 0.0,
    offload: bool = True,
    host_memory_bytes: int | None = None,
    host_reserve: int = HOST_RESERVE_BYTES,
    host_cores: int | None = None,
    device: str = "cuda",
    knobs: Knobs = PLANNED_KNOBS,
    planned_out: bool = False,
) -> list[PlanRow]:
    """Every configuration of the space, fastest fitting first, then the nearest misses.

    Args:
        model: The model shape.
        gpu: The GPU model every rank runs on.
        workload: Sequence length, global batch and number of GPUs.
        engines: Restrict to these engines.
        precision: Defaults to :func:`default_precision` of the GPU.
        attention: Attention kernel.
        gpus_per_node: GPUs sharing a node's fast links.
        reserve: Device bytes kept back (see DEVICE_RESERVE_BYTES).
        headroom: Fraction of memory a fitting configuration must leave free.
        offload: Include the CPU-offload configurations.
        host_memory_bytes: The host memory of a node, for the job; None: the host is not
            checked (predictions are still on every row).
        host_reserve: Host bytes kept for the system (see HOST_RESERVE_BYTES).
        host_cores: CPU cores of a node, which host Adam under offload runs on; None: 16
            per GPU.
        device: ``cuda``, or ``cpu`` when the CPU emulates the device (no pinned memory;
            the device's tensors are host memory).
        knobs: The knobs beyond the ladder to try, each kept only where it pays (module
            docstring).
        planned_out: List the rows left out for not paying too, after the others, each with
            its :attr:`PlanRow.twin` (the search's candidates once a twin's prediction fails).

    Returns:
        One row per configuration.
    """
    capacity = usable_bytes(gpu, reserve=reserve, headroom=headroom)
    host_capacity = None if host_memory_bytes is None else max(0, host_memory_bytes - host_reserve)
    ranks_per_node = min(workload.world_size, gpus_per_node)
    sizes = micro_batch_options(workload)
    rows: list[PlanRow] = []
    for config in configurations(
        world_size=workload.world_size,
        num_layers=model.num_layers,
        engines=engines,
        precision=precision or default_precision(gpu),
        attention=attention,
        offload=offload,
        knobs=knobs,
    ):

        def peak(mbs: int, config: TrainConfig = config) -> MemoryEstimate:
            return estimate_memory(
                model,
                workload.as_trained(config),  # a user's job at one rank: its own wrapper
                micro_batch_size=mbs,
                seq_len=workload.seq_len,
                world_size=workload.world_size,
                cuda_allocator=caching_allocator(gpu),
                grad_accum=workload.grad_accum(mbs),
                loss_dtype=workload.loss_dtype,
            )

        memories = {m: peak(m) for m in sizes}
        times = {
            m: predict_step_time(
                model,
                config,
                gpu,
                micro_batch_size=m,
                seq_len=workload.seq_len,
                grad_accum=workload.grad_accum(m),
                world_size=workload.world_size,
                gpus_per_node=gpus_per_node,
                host_cores=host_cores,
            )
            for m in sizes
        }
        fitting = [m for m in sizes if memories[m].device_bytes <= capacity]
        best = max(fitting, key=lambda m: times[m].tokens_per_second, default=sizes[0])
        host = estimate_host(
            model,
            config,
            world_size=workload.world_size,
            ranks_per_node=ranks_per_node,
            device=device,
            device_bytes=memories[best].peak_bytes,
            activation_bytes=memories[best].offloaded_activation_bytes,
        )
        rows.append(
            PlanRow(
                config=config,
                micro_batch_size=best,
                grad_accum=workload.grad_accum(best),
                memory=memories[best],
                capacity_bytes=capacity,
                time=times[best] if fitting else None,
                peaks={m: e.device_bytes for m, e in memories.items()},
                speeds={m: t.tokens_per_second for m, t in times.items()},
                mfus={m: t.mfu for m, t in times.items() if t.mfu is not None},
                host=host,
                host_capacity_bytes=host_capacity,
            )
        )
    kept, left_out = _paying(rows, capacity)

    def ranked(chosen: list[PlanRow]) -> list[PlanRow]:
        # LoRA trains another model than full fine-tuning: its rows follow the full ones
        # that fit, whatever their speed (they do fewer FLOPs a token).
        return sorted(
            chosen,
            key=lambda r: (
                not r.fits,
                r.config.is_lora,
                not r.host_fits,
                -r.tokens_per_second,
                r.over_bytes,
            ),
        )

    return ranked(kept) + (ranked(left_out) if planned_out else [])


def point_estimates(
    rows: Iterable[PlanRow], workload: Workload
) -> dict[tuple[TrainConfig, int], tuple[float | None, float | None]]:
    """Each configuration's predicted tokens/s and peak bytes at each micro-batch of the
    workload: what a trial records beside its measurement (the prediction gap)."""
    return {
        (row.config, size): (row.speeds.get(size), row.peak_at(size))
        for row in rows
        for size in micro_batch_options(workload)
    }


def _paying(rows: list[PlanRow], capacity: int) -> tuple[list[PlanRow], list[PlanRow]]:
    """``rows`` without those whose knobs that trade time or precision for memory (the chunked
    loss, op-level checkpointing, 8-bit AdamW) buy no larger micro-batch: a row is dropped
    when the same configuration without one of them fits as large a micro-batch (0 where
    nothing fits). Returns the rows kept and those left out, each of the latter with the
    twin that made it pointless."""

    def largest(row: PlanRow) -> int:
        return max((m for m, peak in row.peaks.items() if peak <= capacity), default=0)

    fits = {row.config: largest(row) for row in rows}
    kept, left_out = [], []
    for row in rows:
        config = row.config
        twins = [
            dataclasses.replace(config, **{name: off})
            for name, off in KNOB_OFF.items()
            # The fused loss is no pure trade (it is faster too): it needs no twin to be kept;
            # nor LoRA, another training, which ranks after the full ones instead.
            if getattr(config, name) not in (off, Loss.FUSED) and name != "lora_rank"
        ]
        pointless = [t for t in twins if t in fits and fits[t] >= fits[config]]
        if pointless:
            left_out.append(dataclasses.replace(row, twin=pointless[0]))
            continue
        kept.append(row)
    return kept, left_out
