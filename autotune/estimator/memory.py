"""Peak device memory of one rank, without running anything.

The estimate walks one training step at the granularity of decoder blocks: the forward up to
the loss, the backward block by block from the top, the optimizer step. At each point it adds
what is alive: model states (parameters, optimizer state, flat buffers, as each engine lays
them out), gradients produced so far, activations still saved, weights gathered or cast for
the block at work, and that block's working set. The peak is the largest of those sums, and the
breakdown at the peak says what filled the memory. Walking the step matters: with large
batches the peak comes at the loss (every activation saved, the logits on top), with small
ones at the optimizer step (all gradients, no activations), and with checkpointing in the
backward, while a block is recomputed.

Model states follow what the engines were measured to hold (``bench/model_states.py``,
docs/estimator.md): fused AdamW with fp32 master weights is 16 bytes a parameter (Rajbhandari
et al. 2020, "ZeRO", section 3.1), DeepSpeed ZeRO-1/2 with bf16 is 2 + 24/N, and so on.
Activations come from :mod:`autotune.estimator.activations`. On a CUDA device the caching
allocator holds free blocks it cannot hand out on top of the live tensors: a share of the
activations per engine family (:func:`fragmentation`, measured on an H100). Everything is
closed-form: one estimate takes microseconds, so a planner can walk a whole search space.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from autotune.config import (
    OPTIMIZER_8BIT_BLOCK,
    OPTIMIZER_8BIT_MIN_VALUES,
    Engine,
    LossDtype,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
)
from autotune.estimator.activations import ActivationProfile, activation_profile
from autotune.models import ModelSpec

__all__ = [
    "CATEGORIES",
    "MemoryEstimate",
    "StateLayout",
    "estimate_memory",
    "fragmentation",
    "state_layout",
]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""Breakdown keys: ``buffers`` holds communication buckets, gathered and cast weights."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateLayout:
    """Where one rank's model states live, in bytes (device unless named host)."""

    parameters: float
    """Parameters resident on the device all step (master or sharded copies included)."""
    optimizer: float
    """Optimizer state on the device (Adam moments; master weights of DeepSpeed)."""
    resident_buffers: float
    """Flat gradient buffers and buckets allocated once and kept (DDP, DeepSpeed)."""
    gradients_per_layer: float
    """Gradient bytes one block leaves behind once its backward is done (kept to the step)."""
    gradients_head: float
    """Same for the embeddings, final norm and lm_head."""
    held_per_layer: float
    """Weights held from a block's forward to its backward: FSDP2 ZeRO-2's unsharded block."""
    working_weights: float
    """Weights gathered for the block at work, prefetch included (ZeRO-3, FSDP2)."""
    root_weights: float
    """FSDP2's unsharded root (embeddings, final norm, head), alive through the whole step."""
    layer_backward_buffers: float
    """Per-block gradient buffers in its backward (unsharded grads, reduce-scatter input)."""
    step_extra: float
    """Extra during the optimizer step (ZeRO's partition updates, gathers)."""
    host: float
    """Host memory this rank needs for offloaded states."""
    accumulated_per_layer: float = 0.0
    """Gradient bytes of one block kept from a micro-step to the next while gradients
    accumulate (the last micro-step reduces them): DDP's whole gradients, FSDP2's unsharded
    ones in the reduce dtype, DeepSpeed's compute-dtype gradients or their partition."""
    accumulated_head: float = 0.0
    """Same for the embeddings, final norm and lm_head."""
    accumulated_buffers: float = 0.0
    """Buffers kept from one micro-step's backward into the next one (DeepSpeed's reduce
    bucket)."""
    accumulated_in_place: bool = True
    """Whether a later micro-step's gradients are added into the kept ones as they are made
    (DDP, DeepSpeed: the walk's gradients are part of the kept bytes), or kept beside them
    until the block's reduction frees them (FSDP2: its sharded gradients are made anew)."""


def fragmentation(config: TrainConfig) -> float:
    """Free bytes the CUDA caching allocator cannot hand out at the peak, per activation byte.

    At a step's peak the allocator holds segments that are partly in use: their free blocks
    count in ``max_memory_reserved`` but serve no request larger than the holes, and the retry
    before an OOM (which returns only wholly free segments to the driver) cannot release them.
    The H100 run of 2026-11-23 (measurements/h100-2026-11-23; docs/estimator.md) reads that
    remainder in each OOM message ("reserved by PyTorch but unallocated", after the retry), per
    byte of activations live then: 1.0-2.4 % for single (DDP, unmeasured, is taken alike),
    2.1 % for DeepSpeed with optimizer offload, 5.2 % for FSDP2, 12.9 % and 14.8 % with
    parameter offload (FSDP2's CPUOffloadPolicy, DeepSpeed's offload_param: grid-4, grid-5).
    The fractions follow those readings and give every fit verdict of that run
    (tests/estimator/test_h100_memory.py).
    """
    if config.offload is Offload.PARAMS:
        return 0.12
    if config.engine is Engine.FSDP:
        return 0.05
    return 0.02


def _fraction(model: ModelSpec) -> tuple[float, float]:
    """Parameters per decoder block and outside the blocks (embeddings, final norm, head)."""
    per_layer = model.num_block_params / model.num_layers
    return per_layer, model.num_params - model.num_block_params


def moment_bytes(model: ModelSpec, config: TrainConfig, world_size: int = 1) -> float:
    """Bytes of Adam's two moments on one rank, each tensor's sharded over ``world_size``
    ranks (FSDP2; 1 for single and DDP).

    Fused AdamW keeps them in the master weights' dtype. 8-bit AdamW (torchao's AdamW8bit)
    keeps each tensor's as 1-byte codes with an fp32 scale per block of 256 values and a
    256-entry fp32 code map (``OptimState8bit``: ``codes``, ``scale``, ``qmap``), except
    tensors too small to quantize, which keep plain moments (Dettmers et al. 2022, 8-bit
    Optimizers via Block-wise Quantization; the rule from torchao ``optim/adam.py``).
    """
    master = 2.0 if config.precision is Precision.BF16 else 4.0
    n = float(world_size)
    if config.optimizer is not Optimizer.ADAMW_8BIT:
        return 2 * master * model.num_params / n
    block = OPTIMIZER_8BIT_BLOCK
    total = 0.0
    for values, count in model.parameter_tensors:
        local = values / n
        if local >= OPTIMIZER_8BIT_MIN_VALUES and local.is_integer() and local % block == 0:
            total += count * 2 * (local + 4.0 * local / block + 4.0 * 256)
        else:
            total += count * 2 * master * local
    return total


def state_layout(model: ModelSpec, config: TrainConfig, world_size: int) -> StateLayout:
    """Model-state bytes of one rank of ``world_size`` data-parallel ranks.

    Args:
        model: The model shape.
        config: Engine, ZeRO stage, precision, offload.
        world_size: Data-parallel ranks N the states are sharded over.

    Returns:
        The layout the timeline in :func:`estimate_memory` adds up.
    """
    P, n = float(model.num_params), float(world_size)
    per_layer, root = _fraction(model)
    # Bytes of a weight and of each Adam moment: pure bf16 keeps both in bf16; every other
    # precision keeps fp32 masters (the compute copy is bf16/fp16, or the weight itself in fp32).
    master = 2.0 if config.precision is Precision.BF16 else 4.0
    compute = float(config.precision.compute_bytes)
    engine, stage, offload = config.engine, config.zero_stage, config.offload
    zero: dict[str, Any] = dict(
        resident_buffers=0.0,
        held_per_layer=0.0,
        working_weights=0.0,
        root_weights=0.0,
        layer_backward_buffers=0.0,
        step_extra=0.0,
        host=0.0,
    )
    if config.is_lora:
        return _lora_layout(model, config, zero)
    if engine in (Engine.SINGLE, Engine.DDP):
        # Weights, one gradient per weight, two Adam moments; DDP adds its gradient buckets. A
        # block's backward starts with the gradient of its largest weight made in the compute
        # dtype and accumulated into the fp32 one.
        largest = model.hidden_size * model.intermediate_size
        return StateLayout(
            parameters=master * P,
            optimizer=moment_bytes(model, config),
            gradients_per_layer=master * per_layer,
            gradients_head=master * root,
            **{
                **zero,
                "resident_buffers": master * P if engine is Engine.DDP else 0.0,
                "layer_backward_buffers": (compute + master) * largest,
            },
            # Between micro-steps each weight's gradient stays (DDP's no_sync).
            accumulated_per_layer=master * per_layer,
            accumulated_head=master * root,
        )
    if engine is Engine.FSDP:
        # Sharded fp32 weights, moments and gradients; unsharded compute-dtype weights of the
        # root all step and of the block at work (with the next one prefetched), or of every
        # block between its forward and backward with ZeRO-2 (no re-shard after the forward).
        # A block's backward holds its unsharded gradient and the fp32 copy reduce-scattered.
        on_host = offload is Offload.PARAMS
        sharded = 3 * master * P / n
        reduced = 4.0 if config.precision is Precision.BF16_MIXED else master
        return StateLayout(
            parameters=0.0 if on_host else master * P / n,
            optimizer=0.0 if on_host else moment_bytes(model, config, world_size),
            gradients_per_layer=0.0 if on_host else master * per_layer / n,
            gradients_head=0.0 if on_host else master * root / n,
            resident_buffers=0.0,
            held_per_layer=compute * per_layer if stage == 2 else 0.0,
            working_weights=2 * compute * per_layer,
            root_weights=compute * root,
            layer_backward_buffers=(compute + master) * per_layer,
            step_extra=0.0,
            host=sharded + master * P / n if on_host else 0.0,
            # Without the reduce-scatter (set_requires_gradient_sync(False)) each weight keeps
            # its unsharded gradient, in the reduce dtype (fp32 under bf16 mixed), on the
            # device even with parameter offload, until the last micro-step's reduction.
            accumulated_per_layer=reduced * per_layer,
            accumulated_head=reduced * root,
            accumulated_in_place=False,
        )
    # DeepSpeed (fits of bench/model_states.py and of probes with activations, docs/estimator.md).
    # ZeRO-0 keeps compute-dtype and fp32 weights and the moments resident, makes
    # compute-dtype gradients in the backward and fp32 ones for the step: 20 bytes a parameter.
    # Between micro-steps ZeRO-0 and -1 keep each weight's compute-dtype gradient, ZeRO-2 its
    # reduced partition, and ZeRO-1/2 their reduce bucket (hidden² values, launch.py's
    # bucket sizes); ZeRO-3 accumulates into its resident fp32 partition.
    bucket = compute * model.hidden_size**2
    if stage == 0:
        return StateLayout(
            parameters=(compute + master) * P,
            optimizer=2 * master * P,
            gradients_per_layer=compute * per_layer,
            gradients_head=compute * root,
            **{**zero, "step_extra": master * P},
            accumulated_per_layer=compute * per_layer,
            accumulated_head=compute * root,
        )
    kept: dict[str, Any] = {
        "accumulated_per_layer": 0.0
        if stage == 3
        else compute * per_layer / (n if stage == 2 else 1),
        "accumulated_head": 0.0 if stage == 3 else compute * root / (n if stage == 2 else 1),
        "accumulated_buffers": 0.0 if stage == 3 else bucket,
    }
    # ZeRO-1/2: compute-dtype weights whole, master weights and moments partitioned, and
    # gradient partitions and flat buffers filling up to 2 + 24/N bytes a parameter at the
    # step. ZeRO-3 partitions the weights too and keeps an fp32 gradient partition resident:
    # 28/N in all, plus the blocks gathered for the forward and backward.
    weights = compute * P / n if stage == 3 else compute * P
    states = 3 * master * P / n
    resident_grads = master * P / n if stage == 3 else 0.0
    grads = (24.0 if stage < 3 else 10.0) / n - (12.0 / n if stage < 3 else 0.0)
    if offload is Offload.NONE:
        return StateLayout(
            parameters=weights,
            optimizer=states,
            gradients_per_layer=grads * per_layer,
            gradients_head=grads * root,
            **{
                **zero,
                "resident_buffers": resident_grads,
                "working_weights": 2 * compute * per_layer if stage == 3 else 0.0,
            },
            **kept,
        )
    # Offload: master weights, moments and fp32 gradients on the host; the device keeps the
    # compute-dtype weights (only those gathered for the block at work with parameter offload)
    # and compute-dtype gradient partitions on their way down.
    params_off = offload is Offload.PARAMS
    return StateLayout(
        parameters=0.0 if params_off else weights,
        optimizer=0.0,
        gradients_per_layer=compute * per_layer / n,
        gradients_head=compute * root / n,
        **{
            **zero,
            "working_weights": 2 * compute * per_layer if stage == 3 else 0.0,
            "host": states + master * P / n + (compute * P / n if params_off else 0.0),
        },
        **kept,
    )


def _lora_layout(model: ModelSpec, config: TrainConfig, zero: dict[str, Any]) -> StateLayout:
    """LoRA on the plain engines: the frozen weights in 16 bits (fp32 in fp32), and fp32
    adapters (peft makes them fp32 whatever the base's dtype) with their fp32 gradients and
    Adam moments: 16 bytes an adapter parameter; DDP's buckets hold the adapters' gradients
    alone. A block's backward makes its adapters' gradients, the largest an r × in matrix."""
    frozen = float(config.precision.compute_bytes)
    rank = config.lora_rank
    per_layer = float(model.lora_block_params(rank))
    adapters = float(model.lora_params(rank))
    largest = rank * max((max(i, o) for i, o in model.block_linears), default=0)
    return StateLayout(
        parameters=frozen * model.num_params + 4.0 * adapters,
        optimizer=8.0 * adapters,
        gradients_per_layer=4.0 * per_layer,
        gradients_head=0.0,
        **{
            **zero,
            "resident_buffers": 4.0 * adapters if config.engine is Engine.DDP else 0.0,
            "layer_backward_buffers": 4.0 * largest,
        },
        accumulated_per_layer=4.0 * per_layer,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    """Predicted peak device memory of one rank, and what fills it."""

    peak_bytes: int
    """Live tensor bytes at the step's peak (what ``torch.cuda.max_memory_allocated`` reads)."""
    allocator_bytes: int = 0
    """What the CUDA caching allocator holds on top, unusable, at the step's peak
    (:func:`fragmentation`); 0 where tensors are counted exactly (the CPU's emulated device)."""
    phase: str
    """Where the peak falls: ``forward``, ``loss``, ``backward``, ``optimizer``."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per category at the peak (:data:`CATEGORIES`)."""
    host_bytes: int = 0
    """Host memory for offloaded states, per rank."""
    offloaded_activation_bytes: int = 0
    """Host memory for offloaded activations, per rank (activation offload), unrounded."""
    activation_bytes_per_sample: float = 0.0
    """How :attr:`device_bytes` grows per sequence of micro-batch (slope of the linear memory
    model; the activations and, on a CUDA device, their allocator share)."""

    @property
    def device_bytes(self) -> int:
        """Device memory the peak takes from the allocator's pool: live tensors and the free
        blocks it cannot hand out (the least ``max_memory_reserved`` can read). What must fit
        the usable memory (``autotune.estimator.plan.usable_bytes``)."""
        return self.peak_bytes + self.allocator_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "allocator_bytes": self.allocator_bytes,
            "device_bytes": self.device_bytes,
            "phase": self.phase,
            "breakdown": dict(self.breakdown),
            "host_bytes": self.host_bytes,
            "offloaded_activation_bytes": self.offloaded_activation_bytes,
            "activation_bytes_per_sample": self.activation_bytes_per_sample,
        }


def _checkpointed(layer: int, ac_every: int) -> bool:
    """Whether block ``layer`` is checkpointed (the probe wraps index % k == 0)."""
    return ac_every > 0 and layer % ac_every == 0


def estimate_memory(
    model: ModelSpec,
    config: TrainConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int = 1,
    profile: ActivationProfile | None = None,
    cuda_allocator: bool = True,
    grad_accum: int = 1,
    loss_dtype: LossDtype = LossDtype.FP32,
    in_flight: float = 1.0,
    alongside: float = 0.0,
) -> MemoryEstimate:
    """Peak live device bytes of one rank over a steady-state training step.

    Args:
        model: The model shape.
        config: The configuration.
        micro_batch_size: Sequences per rank per micro-step.
        seq_len: Tokens per sequence.
        world_size: Data-parallel ranks.
        profile: Activation figures to use instead of the analytic ones (a calibration).
        cuda_allocator: Add the CUDA caching allocator's unusable blocks
            (:attr:`MemoryEstimate.allocator_bytes`); False for a device whose tensors are
            counted exactly (the CPU's emulated device memory).
        grad_accum: Micro-steps per optimizer step. From the second one on, the gradients
            kept from the micro-steps before are alive through the forward and backward
            (:class:`StateLayout`'s ``accumulated_*``): 2 or more give one peak.
        loss_dtype: The dtype the job's loss takes the logits in
            (:func:`~autotune.estimator.activations.activation_profile`).
        in_flight: Micro-batches whose activations the rank holds at once: 1, or a pipeline
            stage's (:mod:`autotune.estimator.parallel`); the others' kept activations sit
            beside every point of the forward and backward.
        alongside: Buffers alive through the forward and backward beside the walk's own
            (context parallelism's ring buffers).

    Returns:
        The peak, where it falls, and its breakdown.
    """
    states = state_layout(model, config, world_size)
    prof = profile or activation_profile(model, config, seq_len, loss_dtype)
    tokens = float(micro_batch_size * seq_len)
    layers = model.num_layers
    ac = config.ac_every
    saved = prof.layer_saved_per_token * tokens

    # Whether each block runs its forward again in the backward (whole or op-level).
    again = _recomputed(layers, ac, config.ac_ops)

    def recomputed(j: int) -> bool:
        return again[j]

    kept = [k * tokens for k in _kept_pattern(prof, config, layers)]
    offloaded = offloaded_activation_bytes(model, config, tokens, prof)
    if config.act_offload:
        kept = [0.0] * layers  # on the host, brought back one backward node at a time
    # Weights held from a block's forward to its backward: autocast's bf16 copy (not for a
    # checkpointed block, whose recomputation casts again) and FSDP2 ZeRO-2's unsharded block.
    copy = states.held_per_layer + prof.layer_weight_copy_bytes
    held = [states.held_per_layer if a else copy for a in again]
    base = {
        "parameters": states.parameters,
        "optimizer": states.optimizer,
        "buffers": states.resident_buffers + states.root_weights,
    }
    points: list[tuple[str, dict[str, float]]] = []
    # A later micro-step walks the same points with the kept gradients on top: all of them
    # where its own gradients are added into them, or those of the blocks its backward has
    # not reduced yet (``done``: blocks whose backward is over).
    accumulating = grad_accum > 1
    kept_grads = states.accumulated_head + layers * states.accumulated_per_layer

    def point(phase: str, made: float = 0.0, done: int | None = None, **parts: float) -> None:
        """A point of the walk; ``made``: the weights' gradients among its ``gradients``
        (the rest are the loss's transients); ``done``: blocks whose backward is over, or
        None for the optimizer step (after the last micro-step)."""
        sums = dict.fromkeys(CATEGORIES, 0.0)
        for key, value in [*base.items(), *parts.items()]:
            sums[key] += value
        if phase != "optimizer":
            sums["activations"] += others_kept
            sums["buffers"] += alongside
        points.append((phase, sums))
        if not accumulating or done is None:
            return
        if states.accumulated_in_place:
            more = max(0.0, kept_grads - made)
        else:
            more = states.accumulated_head + (layers - done) * states.accumulated_per_layer
        later = dict(sums)
        later["gradients"] += more
        later["buffers"] += states.accumulated_buffers
        points.append((phase, later))

    head_copy = prof.head_weight_copy_bytes
    head_saved = prof.head_saved_per_token * tokens
    # The loss's transients count the tokens it takes at a time (all, or one chunk's).
    chunk = prof.loss_chunk(tokens)
    # Prefix sums: kept_before[j] is what blocks 0..j-1 hold (O(L) for the whole walk).
    kept_before = list(itertools.accumulate(kept, initial=0.0))
    held_before = list(itertools.accumulate(held, initial=0.0))
    all_kept, all_held = kept_before[-1], held_before[-1]
    # Another micro-batch in flight keeps what its forward saved for its backward: the
    # blocks' kept tensors and the output layer's (a pipeline's last stage under GPipe).
    others_kept = (in_flight - 1.0) * (all_kept + prof.head_saved_per_token * tokens)
    # Forward: the last checkpointed block runs with all its activations (autocast's cache keeps
    # every cast weight until the forward returns).
    last_ck = max((j for j, a in enumerate(again) if a), default=None)
    if last_ck is not None:
        point(
            "forward",
            done=0,
            activations=kept_before[last_ck] + saved,
            buffers=held_before[last_ck + 1]
            + prof.layer_weight_copy_bytes * (last_ck + 1)
            + states.working_weights,
        )
    copies_in_cache = prof.layer_weight_copy_bytes * layers if ac or config.ac_ops else all_held
    point(
        "loss",
        done=0,
        activations=all_kept + head_saved + prof.head_forward_per_token * chunk,
        gradients=prof.head_loss_bytes,
        buffers=max(copies_in_cache, all_held) + head_copy + states.working_weights,
    )
    point(
        "backward",
        done=0,
        activations=all_kept
        + head_saved
        + prof.head_backward_per_token * chunk
        + prof.head_backward_all_per_token * tokens,
        # A chunk's weight gradient is in flight once an earlier chunk left its own.
        gradients=prof.head_loss_bytes + (prof.head_backward_bytes if tokens > chunk else 0.0),
        buffers=all_held + head_copy + states.working_weights,
    )
    # Backward of block j starts with the blocks above done (gradients kept, activations
    # freed) and its own saved tensors (recomputed if checkpointed) plus its working set; it
    # ends with its gradients made and its activations freed. Along the stack these sums are
    # linear within each residue class modulo the checkpointing period, so their maximum lies
    # in the first or last period: only those blocks are walked (O(1) in the depth).
    period = max(ac, 1)
    walked = sorted(set(range(min(period, layers))) | set(range(max(0, layers - period), layers)))
    for j in reversed(walked):
        grads = states.gradients_head + (layers - 1 - j) * states.gradients_per_layer
        if recomputed(j):
            own = prof.layer_recomputed_per_token * tokens
        elif config.act_offload:
            own = prof.layer_unpacked_per_token * tokens  # back one node at a time
        else:
            own = kept[j]
        recast = prof.layer_weight_copy_bytes if recomputed(j) else 0.0
        point(
            "backward",
            made=grads,
            done=layers - 1 - j,
            activations=kept_before[j] + own + prof.layer_backward_per_token * tokens,
            gradients=grads,
            buffers=held_before[j + 1]
            + recast
            + states.working_weights
            + states.layer_backward_buffers,
        )
        point(
            "backward",
            made=grads + states.gradients_per_layer,
            done=layers - j,
            activations=kept_before[j],
            gradients=grads + states.gradients_per_layer,
            buffers=held_before[j] + states.working_weights,
        )
    grads = states.gradients_head + layers * states.gradients_per_layer
    point("optimizer", gradients=grads, buffers=states.step_extra)

    phase, sums = max(points, key=lambda item: sum(item[1].values()))
    breakdown = {key: int(value) for key, value in sums.items()}
    peak = sum(breakdown.values())
    # The allocator's unusable share follows the activations live at each point: the device's
    # peak is the largest of those sums, which may fall elsewhere than the tensors' peak.
    share = fragmentation(config) if cuda_allocator else 0.0
    device = max(sum(parts.values()) + share * parts["activations"] for _, parts in points)
    per_sample = _slope(model, config, seq_len, prof) * (1.0 + share)
    return MemoryEstimate(
        peak_bytes=peak,
        allocator_bytes=max(0, int(device) - peak),
        phase=phase,
        breakdown=breakdown,
        host_bytes=int(states.host),
        offloaded_activation_bytes=int(offloaded),
        activation_bytes_per_sample=per_sample,
    )


def offloaded_activation_bytes(
    model: ModelSpec, config: TrainConfig, tokens: float, prof: ActivationProfile
) -> float:
    """What activation offload keeps on the host per micro-step (and copies over the link
    each way): what the blocks keep from the forward to the backward, their weights aside
    (``autotune.probe.offload``); 0 without it."""
    if not config.act_offload:
        return 0.0
    return tokens * sum(_kept_pattern(prof, config, model.num_layers))


def _slope(model: ModelSpec, config: TrainConfig, seq_len: int, prof: ActivationProfile) -> float:
    """Bytes per extra sequence at the loss point (where large batches peak)."""
    if config.act_offload:
        return (prof.head_saved_per_token + _loss_growth(prof)) * seq_len
    kept = sum(_kept_pattern(prof, config, model.num_layers))
    return (kept + prof.head_saved_per_token + _loss_growth(prof)) * seq_len


@functools.lru_cache(maxsize=256)
def _recomputed(layers: int, ac_every: int, ops: bool) -> tuple[bool, ...]:
    """Whether each block runs its forward again in the backward: checkpointed whole, or
    every block under op-level checkpointing."""
    return tuple(ops or _checkpointed(j, ac_every) for j in range(layers))


def _kept_pattern(prof: ActivationProfile, config: TrainConfig, layers: int) -> list[float]:
    """:func:`_kept_per_token` of every block (a plan asks for thousands of steps)."""
    ck = _recomputed(layers, config.ac_every, False)
    if config.ac_ops:
        rest = [prof.layer_selective_per_token] * layers
    else:
        rest = [prof.layer_saved_per_token] * layers
        rest[0] = prof.layer_saved_per_token - prof.first_block_less_per_token
    inp = prof.layer_input_per_token
    return [inp if c else r for c, r in zip(ck, rest, strict=True)]


def _kept_per_token(prof: ActivationProfile, config: TrainConfig, layer: int) -> float:
    """What a block keeps per token from its forward to its backward: its input when
    checkpointed whole, its input and matmul outputs under op-level checkpointing, else all
    it saves."""
    if _checkpointed(layer, config.ac_every):
        return prof.layer_input_per_token
    if config.ac_ops:
        return prof.layer_selective_per_token
    if layer == 0:
        return prof.layer_saved_per_token - prof.first_block_less_per_token
    return prof.layer_saved_per_token


def _loss_growth(prof: ActivationProfile) -> float:
    """Per token, what the loss's working tensors add as the batch grows: all of them for the
    model's own loss, the fused loss's chunk (which grows with the batch over a share of the
    vocabulary), nothing for the chunked loss's fixed chunk."""
    if prof.head_chunks_of_vocab is not None:
        return prof.head_forward_per_token / prof.head_chunks_of_vocab
    if prof.head_chunk_tokens is None:
        return max(prof.head_forward_per_token, prof.head_backward_per_token)
    return 0.0
