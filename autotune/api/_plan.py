"""``plan``: every configuration ranked by the estimator, without a GPU."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.config import (
    PLANNED_KNOBS,
    Attention,
    Engine,
    Knobs,
    Loss,
    LossDtype,
    Optimizer,
    Precision,
    parse_choice,
    parse_losses,
    parse_optimizers,
)
from autotune.estimator.plan import DEVICE_RESERVE_BYTES, PlanRow
from autotune.estimator.plan import plan as plan_rows
from autotune.hardware import GpuSpec, detect_gpus, host_memory_bytes
from autotune.layouts import LayoutOptions
from autotune.models import ModelSpec, resolve_model
from autotune.space import Workload
from autotune.units import format_bytes
from autotune.values import (
    check_attention,
    count_value,
    degrees_value,
    fraction_value,
    lora_rank_value,
    reserve_bytes,
    size_bytes,
    target_gpu,
    workload_for,
)


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


LARGEST_NODE_HOST_BYTES = 4 << 40
"""The most host memory an 8-GPU server of the DGX class holds: DGX B200, "2 TB using 32 x
DIMMs (upgradable to 4 TB)"; DGX H100 and H200, 2 TB (NVIDIA's DGX B200 user guide and DGX
BasePOD reference architecture). A plan for another node, without ``--host-memory``, takes it
as the node's: a row that needs more fits no such node."""


def _host_assumed(memory: int | None, cores: int | None, *, here: bool) -> HostAssumed:
    """The host a plan assumes: what was given, else this node's when the plan is for this
    node, else the most a DGX-class node holds (:data:`LARGEST_NODE_HOST_BYTES`) and 16
    cores per GPU (a plan for another node must not take this machine's figures: give
    ``--host-memory`` and ``--host-cores`` for it)."""
    elsewhere = "a plan for another node"
    if memory is not None:
        memory_from = "--host-memory"
    elif here:
        memory, memory_from = host_memory_bytes(), "this node's"
    else:
        memory = LARGEST_NODE_HOST_BYTES
        memory_from = (
            f"{elsewhere}: at most the {format_bytes(memory)} of the largest DGX-class node; "
            "give --host-memory to check yours"
        )
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
    tp: str | Sequence[int] | None = None,
    pp: str | Sequence[int] | None = None,
    cp: str | Sequence[int] | None = None,
    tp_across_nodes: bool = False,
) -> Plan:
    """Predict peak memory and throughput of every configuration (no GPU needed): the
    data-parallel ladder, and on more than one GPU the tensor, pipeline and context parallel
    layouts (:mod:`autotune.layouts`) beside it.

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
        tp, pp, cp: The tensor, pipeline and context parallel degrees to plan (``"2,4,8"``);
            default: every degree that splits the model and the world; ``1`` alone for each:
            data parallelism only.
        tp_across_nodes: Let tensor parallelism span nodes.
    """
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    check_attention(Attention(attention), "plan", precision)
    knobs = Knobs(
        losses=parse_losses(losses) or PLANNED_KNOBS.losses,
        op_checkpointing=op_checkpointing,
        optimizers=parse_optimizers(optimizers) or PLANNED_KNOBS.optimizers,
        lora_rank=lora_rank_value(lora_rank),
        activation_offload=activation_offload,
    )
    target, here = target_gpu(gpu)
    detected = detect_gpus() if gpu is not None else None
    local = gpu is None or (
        detected is not None and detected.spec is not None and detected.spec.key == target.key
    )
    host = _host_assumed(
        size_bytes(host_memory, "--host-memory"),
        count_value(host_cores, "--host-cores"),
        here=local,
    )
    layouts = LayoutOptions(
        tp=degrees_value(tp, "--tp"),
        pp=degrees_value(pp, "--pp"),
        cp=degrees_value(cp, "--cp"),
        tp_across_nodes=tp_across_nodes,
    )
    world = count_value(gpus, "--gpus") or here
    # A global batch the GPUs cannot share evenly is refused (data parallelism needs it)
    # unless layouts are asked for by their degrees: theirs may have fewer data-parallel ranks.
    workload = workload_for(spec, seq_len, global_batch, world, layouts=layouts.named)
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
        reserve=reserve_bytes(reserve, target),
        headroom=fraction_value(headroom, "headroom"),
        host_memory_bytes=host.memory_bytes,
        host_cores=host.cores,
        knobs=knobs,
        offload=offload,
        layouts=layouts,
    )
    if not rows:
        workload.check_splits()  # no layout takes a batch data parallelism cannot split
    return Plan(
        model=spec,
        gpu=target,
        workload=workload,
        rows=rows,
        seconds=time.perf_counter() - started,
        host=host,
    )
