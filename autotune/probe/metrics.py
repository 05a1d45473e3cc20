"""Throughput figures from measured phase times: tokens/sec, MFU and HFU.

The probe times forward+backward micro-steps and optimizer steps separately, so the step time
at any gradient-accumulation count follows: ``step = accum * micro_step + optimizer_step``.
Throughput is then tokens per step over that time. Micro-steps are timed at the accumulation
boundary, where gradients are reduced: for the micro-steps in between (no reduction) that is
a slight over-estimate, so throughput at high accumulation is a lower bound.

MFU = achieved model FLOP/s over peak FLOP/s, with model FLOPs per token 6·N + 12·L·H·Q·T
(PaLM, Chowdhery et al. 2022, appendix B). HFU counts the recomputation of checkpointed
blocks as well.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from autotune.config import Loss, checkpointed_fraction
from autotune.models import ModelSpec
from autotune.probe.spec import ProbeSpec

if TYPE_CHECKING:
    import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so wall-clock time covers it."""
    if device.type == "cuda":
        # Imported here: the formulas below serve the tuner too, which never loads torch.
        import torch

        torch.cuda.synchronize(device)


def now() -> float:
    """Monotonic seconds."""
    return time.perf_counter()


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """Speed of one configuration at one micro-batch size."""

    micro_step_s: float
    """Median forward+backward time of one micro-step."""
    optimizer_step_s: float
    """Median optimizer-step time (plus DeepSpeed's boundary work)."""
    step_s: float
    """Time of one optimizer step at the probe's accumulation count."""
    tokens_per_second: float
    """All ranks together."""
    tokens_per_second_per_rank: float
    mfu: float | None
    """Model FLOPs utilization (0..1); None where the peak FLOP/s is unknown (CPU, unknown GPU)."""
    hfu: float | None
    """Hardware FLOPs utilization: MFU plus recomputation."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def throughput(
    *,
    micro_step_s: float,
    optimizer_step_s: float,
    micro_batch_size: int,
    seq_len: int,
    grad_accum: int,
    world_size: int,
    model_flops_per_token: float,
    hardware_flops_per_token: float,
    peak_flops: float | None,
    model_parallel: int = 1,
) -> Throughput:
    """Throughput at any accumulation count from a micro-step and an optimizer-step time.

    The probe passes the medians of its timed window (robust to one slow step); the search
    uses the same function to predict throughput at the user's accumulation count.
    ``model_parallel``: ranks that share each micro-batch (a TP group): the data-parallel
    ranks, ``world_size / model_parallel``, each take a micro-batch.
    """
    step = grad_accum * micro_step_s + optimizer_step_s
    tokens_per_step = micro_batch_size * seq_len * grad_accum * world_size // model_parallel
    tokens_per_second = tokens_per_step / step
    per_rank = tokens_per_second / world_size
    mfu = hfu = None
    if peak_flops:
        mfu = per_rank * model_flops_per_token / peak_flops
        hfu = per_rank * hardware_flops_per_token / peak_flops
    return Throughput(
        micro_step_s=micro_step_s,
        optimizer_step_s=optimizer_step_s,
        step_s=step,
        tokens_per_second=tokens_per_second,
        tokens_per_second_per_rank=per_rank,
        mfu=mfu,
        hfu=hfu,
    )


def probe_throughput(
    spec: ProbeSpec,
    model: ModelSpec,
    micro_batch_size: int,
    *,
    micro_step_s: float,
    optimizer_step_s: float,
    peak_flops: float | None,
) -> Throughput:
    """:func:`throughput` of one probe's size: its workload, ranks and checkpointing."""
    return throughput(
        micro_step_s=micro_step_s,
        optimizer_step_s=optimizer_step_s,
        micro_batch_size=micro_batch_size,
        seq_len=spec.seq_len,
        grad_accum=spec.accumulation(micro_batch_size),
        world_size=spec.world_size,
        model_flops_per_token=model.flops_per_token(spec.seq_len, lora_rank=spec.config.lora_rank),
        hardware_flops_per_token=model.hardware_flops_per_token(
            spec.seq_len,
            checkpointed_fraction(model.num_layers, spec.config.ac_every),
            head_recomputed=spec.config.loss is Loss.CHUNKED,
            lora_rank=spec.config.lora_rank,
        ),
        peak_flops=peak_flops,
        model_parallel=spec.config.model_parallel,
    )
