"""Peak memory and step time of one rank under a tensor, pipeline and context parallel layout.

A rank of a layout runs its share of the model (:func:`autotune.layouts.shard_model`: a
stage's blocks, ``1 / tp`` of their heads and MLP width, one vocabulary table of
``vocab / tp`` rows) on ``seq_len / cp`` tokens of each sequence, its states sharded or
replicated over the data-parallel ranks. Both estimates are built on the data-parallel ones
(:func:`~autotune.estimator.memory.estimate_memory`,
:func:`~autotune.estimator.timing.predict_step_time`) for that share, with what the layout
adds:

Memory (the larger of the first and the last pipeline stage):

- activations: the whole model's per-token figures divided by ``tp``: with sequence
  parallelism every activation of a block is split over the TP ranks (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2, the row
  "tensor + sequence parallel"); at ``seq_len / cp`` tokens a sequence;
- the first stage holds :func:`autotune.layouts.in_flight` microbatches' kept activations
  (p under 1F1B, times ``1 + (p - 1) / (p v)`` interleaved; Korthikanti et al. 2022,
  section 4.2.3) and each one's output, sent on and kept for its backward; the last stage
  holds one (every one under GPipe), with the logits and loss (``vocab / tp`` wide: the
  output layer is split over the vocabulary);
- context parallelism's ring: the key/value chunk in use and the one arriving, each
  ``seq_len / cp`` tokens of ``kv_heads / tp`` heads, in the compute dtype.

Time:

- the stage's compute: the shard's blocks (:func:`autotune.layouts.shard_model`: a TP
  rank's matmuls, attention heads and vocabulary) on ``1 / cp`` of each microbatch's tokens,
  attention over the whole sequence (each rank's queries meet every key around the ring), the
  residual stream's element-wise operators (norms, residual adds) on ``1 / tp`` of those
  tokens (sequence parallelism): the data-parallel model's terms
  (:func:`~autotune.estimator.timing.predict_step_time`'s ``token_share`` and
  ``sequence_share``), host dispatch included;
- the stage's states: their data-parallel collectives and optimizer step as for its share
  (:func:`autotune.layouts.shard_model`), over ``dp * cp`` ranks, one a node per TP group;
- TP: per block and microbatch, two all-gathers and two reduce-scatters of the block's
  input in the forward and as many in the backward (and again for recomputed blocks), over
  the node's links (Korthikanti et al. 2022, section 4.2.2), not overlapped (torch's
  asynchronous TP would hide part of them);
- PP: the bubble, ``(p - 1) / v`` microbatch times on top of ``m`` (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section
  2.2), and the activations sent between stages over the network while the pipeline fills
  and drains;
- CP: the ring's key/value exchange, ``cp - 1`` steps a block forward and three times that
  in the backward with recomputation (keys and values again, their gradients back), hidden
  behind the blocks' compute where it is shorter (at the long sequences CP is planned for,
  attention is most of that compute).

These terms rest on figures this module assumes and no probe has measured yet: the node's
and the network's bandwidth (the hardware catalogue's, with the data-parallel model's
efficiencies), and full exposure of TP's collectives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from autotune.config import LossDtype, TrainConfig, checkpointed_fraction
from autotune.estimator.activations import ActivationProfile, activation_profile
from autotune.estimator.memory import MemoryEstimate, estimate_memory
from autotune.estimator.timing import StepTime, collective_seconds, predict_step_time
from autotune.hardware import GpuSpec
from autotune.layouts import data_parallel, in_flight, shard_model, without_layout
from autotune.models import ModelSpec

__all__ = [
    "estimate_layout_memory",
    "estimate_rank_memory",
    "predict_layout_time",
    "predict_rank_time",
]

_HEAD_FIELDS = (
    "head_saved_per_token",
    "head_forward_per_token",
    "head_backward_per_token",
    "head_backward_all_per_token",
    "head_backward_bytes",
    "head_loss_bytes",
    "head_weight_copy_bytes",
)
"""What only the stage with the output layer holds."""

_GATHERED_FIELDS = ("layer_saved_per_token", "layer_recomputed_per_token")
"""The figures that hold :attr:`ActivationProfile.layer_gathered_per_token` whole."""

_SCALED_FIELDS = (
    "layer_saved_per_token",
    "layer_input_per_token",
    "layer_selective_per_token",
    "layer_backward_per_token",
    "layer_recomputed_per_token",
    "layer_unpacked_per_token",
    "first_block_less_per_token",
    "layer_weight_copy_bytes",
    *_HEAD_FIELDS,
)


@functools.lru_cache(maxsize=1024)
def _rank_profile(prof: ActivationProfile, tp: int, head: bool) -> ActivationProfile:
    """The whole model's figures as one TP rank holds them (divided by ``tp``, but the
    all-gathered inputs of the column-split projections, which a block saves and recomputes
    whole), the output layer's only on the stage that has it."""
    values: dict[str, Any] = {}
    gathered = prof.layer_gathered_per_token
    for name in _SCALED_FIELDS:
        value = getattr(prof, name)
        if name in _HEAD_FIELDS and not head:
            scaled = 0.0
        elif name in _GATHERED_FIELDS:
            scaled = (value - gathered) / tp + gathered
        else:
            scaled = value / tp
        values[name] = int(scaled) if isinstance(value, int) else scaled
    return dataclasses.replace(prof, **values)


@functools.lru_cache(maxsize=1024)
def _profile(
    model: ModelSpec, config: TrainConfig, seq_len: int, loss_dtype: LossDtype
) -> ActivationProfile:
    """The whole model's activation figures, once per plan's configuration and length."""
    return activation_profile(model, config, seq_len, loss_dtype)


_COMPUTE: dict[tuple[Any, ...], tuple[GpuSpec, float]] = {}


def _compute_s(
    shard: ModelSpec,
    config: TrainConfig,
    gpu: GpuSpec,
    micro_batch_size: int,
    seq_len: int,
    host_cores: int | None,
    tp: int,
    cp: int,
) -> float:
    """A stage's forward and backward seconds a microbatch (:func:`predict_layout_time`),
    kept for the layouts that differ in their sharding or schedule alone (keyed by the GPU
    object itself: a spec holds a dict, so it has no hash)."""
    key = (shard, config, id(gpu), micro_batch_size, seq_len, host_cores, tp, cp)
    kept = _COMPUTE.get(key)
    if kept is not None and kept[0] is gpu:
        return kept[1]
    seconds = predict_step_time(
        shard,
        config,
        gpu,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        host_cores=host_cores,
        token_share=1.0 / cp,
        sequence_share=1.0 / tp,
    ).compute_s
    if len(_COMPUTE) >= 4096:
        _COMPUTE.clear()
    _COMPUTE[key] = (gpu, seconds)
    return seconds


def _ring_bytes(model: ModelSpec, config: TrainConfig, tokens: float) -> float:
    """Context parallelism's key/value buffers: the chunk in use and the one arriving."""
    if config.cp == 1:
        return 0.0
    kv = model.num_key_value_heads // config.tp * model.head_dim
    return 2.0 * 2.0 * tokens * kv * config.precision.compute_bytes


def estimate_layout_memory(
    model: ModelSpec,
    config: TrainConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    grad_accum: int = 1,
    cuda_allocator: bool = True,
    loss_dtype: LossDtype = LossDtype.FP32,
) -> MemoryEstimate:
    """Peak device memory of the most loaded rank of a layout: the larger of the first
    pipeline stage (the most microbatches in flight) and the last (the logits and loss).

    Args:
        model: The whole model.
        config: The configuration, its layout included.
        micro_batch_size: Sequences a microbatch.
        seq_len: Tokens a sequence (each rank holds ``seq_len / cp`` of them).
        world_size: All ranks.
        grad_accum: Microbatches a step (the pipeline's ``m``).
        cuda_allocator: As for :func:`~autotune.estimator.memory.estimate_memory`.
        loss_dtype: As for :func:`~autotune.estimator.memory.estimate_memory`.
    """
    local = without_layout(config)
    shard = shard_model(model, config)
    seq = seq_len // config.cp
    whole = _profile(model, local, seq, loss_dtype)
    # FSDP2 shards the states over the data-parallel and the context-parallel ranks.
    sharded_over = data_parallel(config, world_size) * config.cp
    tokens = float(micro_batch_size * seq)
    ring = _ring_bytes(model, config, tokens)
    stages = [(True, 1.0)] if config.pp == 1 else [(False, in_flight(config, grad_accum))]
    if config.pp > 1:  # the last stage: one microbatch in flight, every one under GPipe
        stages.append((True, in_flight(config, grad_accum, last=True)))
    estimates = []
    for head, held in stages:
        profile = _rank_profile(whole, config.tp, head)
        # A stage before the last keeps each microbatch's output (its last block's output,
        # sent on) until that microbatch's backward: the next stage's input, whose first
        # block keeps its own copy.
        sent = 0.0 if head else held * profile.layer_input_per_token * tokens
        estimates.append(
            estimate_memory(
                shard,
                local,
                micro_batch_size=micro_batch_size,
                seq_len=seq,
                world_size=sharded_over,
                profile=profile,
                cuda_allocator=cuda_allocator,
                grad_accum=grad_accum,
                loss_dtype=loss_dtype,
                in_flight=held,
                alongside=ring + sent,
            )
        )
    return max(estimates, key=lambda e: e.device_bytes)


def predict_layout_time(
    model: ModelSpec,
    config: TrainConfig,
    gpu: GpuSpec,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    grad_accum: int = 1,
    gpus_per_node: int = 8,
    host_cores: int | None = None,
) -> StepTime:
    """Predicted step time of a layout, tokens/s of all ranks and MFU (module docstring).
    The optimizer step's time holds what a step adds beyond its microbatches: the pipeline's
    bubble and its sends, then the step itself.

    Args:
        model: The whole model.
        config: The configuration, its layout included.
        gpu: The GPU every rank has.
        micro_batch_size: Sequences a microbatch.
        seq_len: Tokens a sequence.
        world_size: All ranks.
        grad_accum: Microbatches a step (the pipeline's ``m``).
        gpus_per_node: GPUs a node; TP's group stays inside one.
        host_cores: As for :func:`~autotune.estimator.timing.predict_step_time`.
    """
    tp, pp, cp = config.tp, config.pp, config.cp
    local = without_layout(config)
    shard = shard_model(model, config)
    seq = seq_len // cp
    dp = data_parallel(config, world_size)
    sharded_over = dp * cp
    # The data-parallel group: one rank a node per TP group (TP fills the node's GPUs).
    per_node = max(1, gpus_per_node // tp)
    # The stage's states: their collectives and optimizer step, as data parallelism's.
    stage = predict_step_time(
        shard,
        local,
        gpu,
        micro_batch_size=micro_batch_size,
        seq_len=seq,
        grad_accum=grad_accum,
        world_size=sharded_over,
        gpus_per_node=min(per_node, sharded_over),
        host_cores=host_cores,
    )
    # The stage's compute: the shard's blocks on 1 / cp of each microbatch's tokens, their
    # residual stream's operators on 1 / tp of those (sequence parallelism), attention
    # spanning the whole sequence (each rank's queries meet every key around the ring).
    layers = shard.num_layers
    compute = _compute_s(shard, local, gpu, micro_batch_size, seq_len, host_cores, tp, cp)
    tokens = float(micro_batch_size * seq)
    dtype = config.precision.compute_bytes
    recomputed = checkpointed_fraction(layers, config.ac_every)
    # TP: 2 all-gathers + 2 reduce-scatters of the block's input, forward and backward.
    tp_s = 0.0
    if tp > 1:
        block_input = tokens * model.hidden_size * dtype
        calls = layers * 4 * (2.0 + recomputed)
        each = collective_seconds(
            gpu, "ag", block_input, ranks=tp, ranks_per_node=min(tp, gpus_per_node)
        )
        tp_s = each * calls
    # CP: the key/value chunk passed around the ring, forward and backward (keys and values
    # out, their gradients back), hidden behind the attention it feeds where it is shorter.
    ring_s = 0.0
    if cp > 1:
        kv = tokens * shard.num_key_value_heads * shard.head_dim * dtype * 2
        hop = collective_seconds(
            gpu, "ag", kv * 2, ranks=2, ranks_per_node=2 if per_node > 1 else 1
        )
        ring_s = max(0.0, layers * (cp - 1) * hop * (3.0 + recomputed) - compute)
    micro = compute + tp_s + ring_s
    accumulate = stage.accumulation_micro_step_s - stage.compute_s + micro
    boundary = stage.micro_step_s - stage.compute_s + micro
    # PP: the bubble ((p - 1) / v microbatch times) and the sends on the critical path.
    bubble = 0.0
    sends = 0.0
    if pp > 1:
        bubble = (pp - 1) / config.pp_virtual * micro
        activation = tokens * model.hidden_size * dtype / tp
        sends = (
            2 * (pp - 1) * collective_seconds(gpu, "ag", activation * 2, ranks=2, ranks_per_node=1)
        )
    step_s = grad_accum * boundary + bubble + sends + stage.optimizer_step_s
    exact = (grad_accum - 1) * accumulate + boundary + bubble + sends + stage.optimizer_step_s
    tokens_per_second = micro_batch_size * seq_len * grad_accum * dp / step_s
    peak = gpu.peak(config.precision.compute_dtype)
    fraction = checkpointed_fraction(model.num_layers, config.ac_every)
    per_rank = tokens_per_second / world_size
    mfu = per_rank * model.flops_per_token(seq_len) / peak if peak else None
    hfu = per_rank * model.hardware_flops_per_token(seq_len, fraction) / peak if peak else None
    return StepTime(
        compute_s=micro,
        communication_s=boundary - micro,
        offload_s=0.0,
        micro_step_s=boundary,
        accumulation_micro_step_s=accumulate,
        optimizer_step_s=stage.optimizer_step_s + bubble + sends,
        step_s=step_s,
        exact_step_s=exact,
        tokens_per_second=tokens_per_second,
        mfu=mfu,
        hfu=hfu,
    )


def estimate_rank_memory(
    model: ModelSpec,
    config: TrainConfig,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    grad_accum: int = 1,
    cuda_allocator: bool = True,
    loss_dtype: LossDtype = LossDtype.FP32,
) -> MemoryEstimate:
    """A rank's memory under any configuration: :func:`estimate_layout_memory` for a layout,
    the data-parallel estimate (:func:`~autotune.estimator.memory.estimate_memory`) for the
    rest (the same figures at degree 1, without the layout's detour)."""
    estimate = estimate_layout_memory if config.is_layout else estimate_memory
    return estimate(
        model,
        config,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        world_size=world_size,
        grad_accum=grad_accum,
        cuda_allocator=cuda_allocator,
        loss_dtype=loss_dtype,
    )


def predict_rank_time(
    model: ModelSpec,
    config: TrainConfig,
    gpu: GpuSpec,
    *,
    micro_batch_size: int,
    seq_len: int,
    world_size: int,
    grad_accum: int = 1,
    gpus_per_node: int = 8,
    host_cores: int | None = None,
) -> StepTime:
    """A step's predicted time under any configuration: :func:`predict_layout_time` for a
    layout, :func:`~autotune.estimator.timing.predict_step_time` for the rest."""
    predict = predict_layout_time if config.is_layout else predict_step_time
    return predict(
        model,
        config,
        gpu,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        world_size=world_size,
        grad_accum=grad_accum,
        gpus_per_node=gpus_per_node,
        host_cores=host_cores,
    )
