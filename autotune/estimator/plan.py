"""Rank every configuration of the space by predicted throughput, without a GPU.

For each configuration the planner finds the largest micro-batch that fits the GPU's memory
(peak memory grows with the micro-batch, so a bisection over the sizes that reach the global
batch exactly), predicts the step time at every size that fits, and keeps the fastest.
Configurations that fit at no size are listed after, with how much they miss by.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from autotune.config import Attention, Engine, Precision, TrainConfig
from autotune.estimator.memory import MemoryEstimate, estimate_memory
from autotune.estimator.timing import StepTime, predict_step_time
from autotune.hardware import GpuSpec
from autotune.models import ModelSpec
from autotune.space import Workload, configurations, micro_batch_options

__all__ = ["DEVICE_RESERVE_BYTES", "PlanRow", "default_precision", "plan", "usable_bytes"]

DEVICE_RESERVE_BYTES = 1024**3
"""Device memory tensors cannot use: the CUDA context, cuBLAS and NCCL workspaces, and the
caching allocator's fragmentation, which ``max_memory_allocated`` does not show. An assumption
(1 GiB) until GPU runs measure it (docs/gpu-results.md); ``--reserve`` overrides it."""


def usable_bytes(
    gpu: GpuSpec, *, reserve: int = DEVICE_RESERVE_BYTES, headroom: float = 0.0
) -> int:
    """Bytes of live tensors one GPU can hold: its memory less the reserve, less headroom.

    Args:
        gpu: The GPU.
        reserve: Bytes kept for the CUDA context and allocator (see DEVICE_RESERVE_BYTES).
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

    @property
    def fits(self) -> bool:
        return self.memory.peak_bytes <= self.capacity_bytes

    @property
    def over_bytes(self) -> int:
        """How far the peak exceeds the capacity (0 when it fits)."""
        return max(0, self.memory.peak_bytes - self.capacity_bytes)

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
            "memory": self.memory.to_dict(),
            "time": self.time.to_dict() if self.time else None,
        }


def _largest_fitting(
    sizes: list[int], peak: Any, capacity: int
) -> tuple[int | None, dict[int, MemoryEstimate]]:
    """Bisect the sorted ``sizes`` for the largest whose peak fits; returns it and the probes."""
    seen: dict[int, MemoryEstimate] = {}
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        seen[sizes[mid]] = estimate = peak(sizes[mid])
        if estimate.peak_bytes <= capacity:
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best, seen


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

    Returns:
        One row per configuration.
    """
    capacity = usable_bytes(gpu, reserve=reserve, headroom=headroom)
    sizes = micro_batch_options(workload)
    rows: list[PlanRow] = []
    for config in configurations(
        world_size=workload.world_size,
        num_layers=model.num_layers,
        engines=engines,
        precision=precision or default_precision(gpu),
        attention=attention,
    ):

        def peak(mbs: int, config: TrainConfig = config) -> MemoryEstimate:
            return estimate_memory(
                model,
                config,
                micro_batch_size=mbs,
                seq_len=workload.seq_len,
                world_size=workload.world_size,
            )

        largest, seen = _largest_fitting(sizes, peak, capacity)
        if largest is None:
            smallest = sizes[0]
            rows.append(
                PlanRow(
                    config=config,
                    micro_batch_size=smallest,
                    grad_accum=workload.grad_accum(smallest),
                    memory=seen.get(smallest) or peak(smallest),
                    capacity_bytes=capacity,
                    time=None,
                )
            )
            continue
        best: PlanRow | None = None
        for mbs in (m for m in sizes if m <= largest):
            accum = workload.grad_accum(mbs)
            time = predict_step_time(
                model,
                config,
                gpu,
                micro_batch_size=mbs,
                seq_len=workload.seq_len,
                grad_accum=accum,
                world_size=workload.world_size,
                gpus_per_node=gpus_per_node,
            )
            if best is None or time.tokens_per_second > best.tokens_per_second:
                memory = seen.get(mbs) or peak(mbs)
                best = PlanRow(
                    config=config,
                    micro_batch_size=mbs,
                    grad_accum=accum,
                    memory=memory,
                    capacity_bytes=capacity,
                    time=time,
                )
        assert best is not None
        rows.append(best)
    return sorted(rows, key=lambda r: (not r.fits, -r.tokens_per_second, r.over_bytes))
