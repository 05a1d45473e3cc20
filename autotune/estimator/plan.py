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
from collections.abc import Callable, Iterable, Mapping
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
from autotune.estimator.memory import MemoryEstimate
from autotune.estimator.parallel import estimate_rank_memory, predict_rank_time
from autotune.estimator.timing import StepTime
from autotune.hardware import GpuSpec
from autotune.layouts import (
    LayoutOptions,
    data_parallel,
    layout_configs,
    pipeline_microbatches_ok,
    shard_model,
    without_layout,
)
from autotune.models import ModelSpec
from autotune.space import Workload, configurations, divisors, micro_batch_options
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
    layouts: LayoutOptions | None = None,
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
        layouts: Rank tensor, pipeline and context parallel layouts too
            (:func:`autotune.layouts.layout_configs`, :mod:`autotune.estimator.parallel`),
            each at the micro-batches whose accumulation its schedule can run; None: data
            parallelism alone (the search probes nothing else yet).

    Returns:
        One row per configuration.
    """
    capacity = usable_bytes(gpu, reserve=reserve, headroom=headroom)
    host_capacity = None if host_memory_bytes is None else max(0, host_memory_bytes - host_reserve)
    ranks_per_node = min(workload.world_size, gpus_per_node)
    sizes = micro_batch_options(workload) if workload.splits_evenly else []
    cuda = caching_allocator(gpu)

    def peak(config: TrainConfig, m: int, accum: int) -> MemoryEstimate:
        return estimate_rank_memory(
            model,
            workload.as_trained(config),  # a user's job at one rank: its own wrapper
            micro_batch_size=m,
            seq_len=workload.seq_len,
            world_size=workload.world_size,
            cuda_allocator=cuda,
            grad_accum=accum,
            loss_dtype=workload.loss_dtype,
        )

    def row(config: TrainConfig, sizes: list[int], accum: Callable[[int], int]) -> PlanRow:
        """``config`` at its fastest fitting size (``accum``: a size's accumulation). A
        layout's sizes stop at the first that misses (memory grows with the size; the search
        reads every size of the data-parallel rows only)."""
        layout = config.is_layout
        world = workload.world_size
        memories: dict[int, MemoryEstimate] = {}
        for m in sizes:
            memories[m] = peak(config, m, accum(m))
            if layout and memories[m].device_bytes > capacity:
                break
        sizes = list(memories)
        times = {
            m: predict_rank_time(
                model,
                config,
                gpu,
                micro_batch_size=m,
                seq_len=workload.seq_len,
                grad_accum=accum(m),
                world_size=world,
                gpus_per_node=gpus_per_node,
                host_cores=host_cores,
            )
            for m in sizes
        }
        fitting = [m for m in sizes if memories[m].device_bytes <= capacity]
        best = max(fitting, key=lambda m: times[m].tokens_per_second, default=sizes[0])
        host = estimate_host(
            shard_model(model, config) if layout else model,
            without_layout(config),
            world_size=data_parallel(config, world) * config.cp,
            ranks_per_node=ranks_per_node,
            device=device,
            device_bytes=memories[best].peak_bytes,
            activation_bytes=memories[best].offloaded_activation_bytes,
        )
        return PlanRow(
            config=config,
            micro_batch_size=best,
            grad_accum=accum(best),
            memory=memories[best],
            capacity_bytes=capacity,
            time=times[best] if fitting else None,
            peaks={m: e.device_bytes for m, e in memories.items()},
            speeds={m: t.tokens_per_second for m, t in times.items()},
            mfus={m: t.mfu for m, t in times.items() if t.mfu is not None},
            host=host,
            host_capacity_bytes=host_capacity,
        )

    # Data parallelism needs as many sequences for every GPU (a layout may need fewer).
    rows = [
        row(config, sizes, workload.grad_accum)
        for config in configurations(
            world_size=workload.world_size,
            num_layers=model.num_layers,
            engines=engines,
            precision=precision or default_precision(gpu),
            attention=attention,
            offload=offload,
            knobs=knobs,
            job_engines=workload.job_engines,  # a user's job: the engines it trains under
        )
        if sizes
    ]
    if layouts is not None:
        rows += _layout_rows(
            model,
            workload,
            layouts,
            row,
            engines=engines,
            gpus_per_node=gpus_per_node,
            precision=precision or default_precision(gpu),
            attention=attention,
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


def _layout_rows(
    model: ModelSpec,
    workload: Workload,
    options: LayoutOptions,
    row: Callable[[TrainConfig, list[int], Callable[[int], int]], PlanRow],
    *,
    engines: Iterable[Engine] | None,
    gpus_per_node: int,
    precision: Precision,
    attention: Attention,
) -> list[PlanRow]:
    """The layouts' rows: each at the micro-batches that split its data-parallel ranks' share
    of the global batch and leave its pipeline schedule enough microbatches.

    A layout's leanest configuration (ZeRO-3, every block checkpointed) is estimated first:
    where it misses at its smallest micro-batch the others of its family (the same degrees
    and schedule), which hold more at every point of the step, miss too, and only its row is
    kept (the nearest miss)."""
    configs = layout_configs(
        model,
        world_size=workload.world_size,
        gpus_per_node=gpus_per_node,
        seq_len=workload.seq_len,
        precision=precision,
        attention=attention,
        engines=engines,
        tp=options.tp,
        pp=options.pp,
        cp=options.cp,
        tp_across_nodes=options.tp_across_nodes,
    )
    families: dict[TrainConfig, list[TrainConfig]] = {}
    for config in configs:
        families.setdefault(_family(config), []).append(config)
    rows = []
    for family in families.values():
        family.sort(key=_leanest_first)
        for index, config in enumerate(family):
            dp = data_parallel(config, workload.world_size)
            if workload.global_batch % dp:
                break
            share = workload.global_batch // dp

            def accum(m: int, share: int = share) -> int:
                return share // m

            sizes = [m for m in divisors(share) if pipeline_microbatches_ok(config, share // m)]
            if not sizes:
                break
            found = row(config, sizes, accum)
            rows.append(found)
            if index == 0 and found.memory.device_bytes > found.capacity_bytes:
                break  # the rest of the family holds more
    return rows


def _family(config: TrainConfig) -> TrainConfig:
    """A layout's family: its degrees and schedule, whatever its sharding and checkpointing
    (as its leanest member)."""
    return dataclasses.replace(config, zero_stage=config.zero_stage and 3, ac_every=1, ac_ops=False)


def _leanest_first(config: TrainConfig) -> tuple[int, int]:
    """ZeRO-3 before ZeRO-2, then every block checkpointed, op-level, none: the first holds
    the least."""
    checkpointing = 0 if config.ac_every == 1 else 1 if config.ac_ops else 2
    return (-config.zero_stage, checkpointing)


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
