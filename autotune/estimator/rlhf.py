"""Memory and time of one RL iteration (PPO, GRPO) with a colocated rollout engine.

An iteration has three phases on every GPU, in turn:

- **rollout**: the engine (one vLLM instance a GPU, tensor-parallel 1, as TRL's colocate
  mode and OpenRLHF's hybrid engine run it) holds its share of the GPU: the policy's weights
  in bf16, the workspace of its profiling forward, its CUDA graphs and, in what is left of
  the share, the KV cache. Beside it stays what the trainer keeps between steps: each
  trained model's states (parameters, optimizer, resident gradient buffers, as
  :func:`autotune.estimator.memory.state_layout` lays them out) and the frozen models kept
  on the GPU.
- **scoring**: a forward of each model over the generated sequences at the trainer's
  micro-batch (the policy's old log-probabilities, the reference's, the critic's values, the
  reward model's scores); an offloaded frozen model comes to the GPU for its forward.
- **training**: the policy's optimizer step over the batch (and the critic's, for PPO), one
  after the other: the peak is one model's training peak
  (:func:`~autotune.estimator.memory.estimate_memory`) with the other's states beside it.

The engine holds its whole share through scoring and training unless it sleeps (vLLM's sleep
mode, level 1: weights to the host, KV cache freed), which costs moving its weights out and
back every iteration. A configuration fits when every phase fits the GPU; a miss names the
phase and by how much, and the largest share at which it would fit.

Time: the rollout follows a roofline (Williams et al. 2009): a decode step reads every weight
and the KV cache of the sequences decoding (bandwidth-bound at small batches, Pope et al. 2022,
"Efficiently Scaling Transformer Inference", section 2), or does 2·P FLOPs a sequence
(compute-bound at large ones), whichever is longer, plus a fixed per-step overhead of the
engine's scheduler and sampler; a prefill is compute-bound. Scoring is the forward third of
the trainer's predicted compute (:func:`~autotune.estimator.timing.predict_step_time`, whose
constants were fitted on H100 probes); training is that prediction's step. **The rollout's
efficiencies and the engine's overheads below are assumptions, not measurements**: no GPU run
of vLLM has set them yet (docs/rlhf.md lists what to measure).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from autotune.config import LADDER_ONLY, Attention, Engine, Precision, TrainConfig
from autotune.estimator.activations import activation_profile
from autotune.estimator.memory import MemoryEstimate, estimate_memory, state_layout
from autotune.estimator.plan import (
    DEVICE_RESERVE_BYTES,
    caching_allocator,
    default_precision,
    usable_bytes,
)
from autotune.estimator.timing import StepTime, predict_step_time
from autotune.hardware import GpuSpec
from autotune.models import ModelSpec
from autotune.space import Workload, configurations, micro_batch_options
from autotune.tuned.rlhf import Placement, RLHFWorkload, sharded
from autotune.units import format_bytes

__all__ = [
    "DECODE_BANDWIDTH_EFFICIENCY",
    "ENGINE_ASLEEP_BYTES",
    "ENGINE_GRAPH_BYTES",
    "ENGINE_MAX_SEQS",
    "ENGINE_PROFILE_TOKENS",
    "KV_BLOCK_TOKENS",
    "EngineEstimate",
    "RLHFRow",
    "engine_estimate",
    "estimate_rlhf",
    "kv_bytes_per_token",
    "plan_rlhf",
]

KV_BLOCK_TOKENS = 16
"""vLLM's default KV cache block: a sequence takes whole blocks."""
ENGINE_MAX_SEQS = 256
"""vLLM's default ``max_num_seqs``: sequences decoding at once, whatever the cache holds."""
ENGINE_PROFILE_TOKENS = 8192
"""vLLM's default ``max_num_batched_tokens``: its profiling forward's tokens, whose workspace
the share must hold beside the weights."""
ENGINE_GRAPH_BYTES = 512 * 1024**2
"""The engine's CUDA graphs and non-torch allocations (NCCL, cuBLAS workspaces). Assumed
(vLLM logs 0.3-1 GiB for graph capture of small models); not measured here."""
ENGINE_ASLEEP_BYTES = ENGINE_GRAPH_BYTES
"""What a sleeping engine keeps on the GPU (level 1 frees the KV cache and moves the weights
to the host; the graphs' pool stays). Assumed."""
DECODE_BANDWIDTH_EFFICIENCY = 0.6
"""Share of the HBM bandwidth a decode step reaches reading weights and KV cache. Assumed."""
ROLLOUT_FLOPS_EFFICIENCY = 0.5
"""Share of the dense bf16 peak a prefill (and a compute-bound decode step) reaches. Assumed."""
DECODE_STEP_OVERHEAD_S = 2e-3
"""The engine's per-step scheduling and sampling time, not hidden by the GPU. Assumed."""
HOST_COPY_EFFICIENCY = 0.86
"""Share of the host link a bulk weight copy reaches (FSDP2's measured parameter offload rate,
taken for the engine's sleep and an offloaded frozen model's load)."""
SCORING_LOGIT_BYTES = 2 + 4 + 4
"""Bytes per logit of a scoring forward: the head's bf16 output, its fp32 copy and the fp32
log-softmax the log-probabilities are gathered from."""


def kv_bytes_per_token(model: ModelSpec, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token takes: a key and a value per layer and key-value head."""
    return 2 * model.num_layers * model.num_key_value_heads * model.head_dim * dtype_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineEstimate:
    """The rollout engine on one GPU at a share."""

    share: float
    share_bytes: int
    """``share`` of the GPU's memory: what the engine claims (vLLM's
    ``gpu_memory_utilization`` is a fraction of the whole memory)."""
    weight_bytes: int
    workspace_bytes: int
    """Its profiling forward's activations and the sampler's logits, plus graphs
    (:data:`ENGINE_GRAPH_BYTES`)."""
    kv_bytes: int
    """What is left of the share for the KV cache (negative: the share cannot hold the rest)."""
    sequence_kv_bytes: int
    """One sequence of ``seq_len`` tokens in whole KV blocks."""
    emulated: bool = False
    """The CPU's emulated device: the engine is only its reservation (a probe holds it as one
    block), nothing inside it is modelled, and it keeps nothing asleep."""

    @property
    def sequences(self) -> int:
        """Sequences whose whole KV cache fits at once (vLLM's "maximum concurrency")."""
        return max(0, self.kv_bytes // self.sequence_kv_bytes)

    @property
    def starts(self) -> bool:
        """vLLM starts only when the cache holds one sequence of ``max_model_len`` (an
        emulated reservation always "starts")."""
        return self.emulated or self.sequences >= 1

    @property
    def asleep_bytes(self) -> int:
        """What the engine keeps on the device while it sleeps."""
        return 0 if self.emulated else ENGINE_ASLEEP_BYTES

    def to_dict(self) -> dict[str, Any]:
        return {
            "share": self.share,
            "share_bytes": self.share_bytes,
            "weight_bytes": self.weight_bytes,
            "workspace_bytes": self.workspace_bytes,
            "kv_bytes": self.kv_bytes,
            "sequence_kv_bytes": self.sequence_kv_bytes,
            "sequences_at_once": self.sequences,
        }


def engine_estimate(model: ModelSpec, gpu: GpuSpec, share: float, seq_len: int) -> EngineEstimate:
    """The engine's memory at ``share`` of ``gpu`` for sequences of ``seq_len`` tokens (on the
    CPU's emulated device: the reservation alone)."""
    share_bytes = int(share * gpu.memory_bytes)
    emulated = not caching_allocator(gpu)
    weights = 0 if emulated else 2 * model.num_params
    d, i = model.hidden_size, model.intermediate_size
    workspace = (
        0
        if emulated
        else ENGINE_PROFILE_TOKENS * (4 * d + 3 * i) * 2
        + ENGINE_MAX_SEQS * model.vocab_size * 4
        + ENGINE_GRAPH_BYTES
    )
    blocks = math.ceil(seq_len / KV_BLOCK_TOKENS)
    return EngineEstimate(
        share=share,
        share_bytes=share_bytes,
        weight_bytes=weights,
        workspace_bytes=workspace,
        kv_bytes=share_bytes - weights - workspace,
        sequence_kv_bytes=blocks * KV_BLOCK_TOKENS * kv_bytes_per_token(model),
        emulated=emulated,
    )


def rollout_seconds(
    model: ModelSpec, gpu: GpuSpec, engine: EngineEstimate, work: RLHFWorkload
) -> float:
    """Time one GPU's engine takes to generate its sequences of the iteration (module
    docstring: a roofline with assumed efficiencies)."""
    peak = (gpu.peak("bf16") or gpu.peak("fp16") or 1.0) * ROLLOUT_FLOPS_EFFICIENCY
    bandwidth = gpu.hbm_bandwidth * DECODE_BANDWIDTH_EFFICIENCY
    n = work.per_rank
    at_once = min(n, engine.sequences, ENGINE_MAX_SEQS)
    if at_once < 1:
        return math.inf
    waves = math.ceil(n / at_once)
    flops = 2.0 * model.num_params
    prefill = flops * at_once * work.prompt_len / peak
    context = work.prompt_len + work.response_len / 2  # the average over the decode
    read = engine.weight_bytes + at_once * context * kv_bytes_per_token(model)
    step = max(read / bandwidth, flops * at_once / peak) + DECODE_STEP_OVERHEAD_S
    return waves * (prefill + work.response_len * step)


@dataclass(frozen=True, kw_only=True, slots=True)
class RLHFRow:
    """One layout of the iteration (trainer configuration, engine share and sleep, frozen
    models' placement) at its best micro-batch, or at micro-batch 1 when nothing fits."""

    config: TrainConfig
    share: float
    sleep: bool
    frozen: Placement
    micro_batch_size: int
    grad_accum: int
    capacity_bytes: int
    """Device bytes a GPU can give (its memory less the reserve)."""
    engine: EngineEstimate
    parts: dict[str, dict[str, int]]
    """What fills a GPU at each phase's peak (``rollout``, ``scoring``, ``training``): the
    ``engine``'s share (or what it keeps asleep), the ``trained states`` kept between steps,
    the ``frozen`` models' weights on the GPU, the scoring ``forward``'s transient, and the
    ``training`` peak (one trained model's step, the other's states beside it)."""
    seconds: dict[str, float]
    """Predicted seconds of each phase of an iteration, and of ``switch`` (the engine's
    sleep and wake, offloaded frozen models brought in)."""
    samples: int
    """Sequences an iteration generates and trains on (all GPUs)."""
    seq_len: int
    max_share: float | None
    """The largest share at which this layout fits (None: none does)."""
    training: MemoryEstimate = field(repr=False)
    """The policy's training estimate at the row's micro-batch."""

    @property
    def phases(self) -> dict[str, int]:
        """Device bytes of a GPU at each phase's peak."""
        return {phase: sum(parts.values()) for phase, parts in self.parts.items()}

    @property
    def iteration_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def over(self) -> dict[str, int]:
        """Bytes each phase exceeds the capacity by (phases that fit left out)."""
        cap = self.capacity_bytes
        return {phase: used - cap for phase, used in self.phases.items() if used > cap}

    @property
    def fits(self) -> bool:
        return self.engine.starts and not self.over

    @property
    def samples_per_second(self) -> float:
        """Predicted samples a second; 0 where the layout does not fit."""
        return self.speed if self.fits else 0.0

    @property
    def speed(self) -> float:
        """Predicted samples a second were the layout to fit (0 where its engine cannot
        start)."""
        seconds = self.iteration_s
        return self.samples / seconds if math.isfinite(seconds) and seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.samples_per_second * self.seq_len

    @property
    def miss(self) -> str | None:
        """Why the layout does not fit (the first phase that fails, by how much, and the
        share that would fit); None when it fits."""
        cure = (
            f"; fits at --rollout-share {self.max_share:.2f} or less"
            if self.max_share is not None
            else ""
        )
        engine = self.engine
        if not engine.starts:
            short = format_bytes(engine.sequence_kv_bytes - engine.kv_bytes)
            if engine.kv_bytes < 0:
                return (
                    f"rollout: the engine's {self.share:.0%} ({format_bytes(engine.share_bytes)}) "
                    f"is {short} short: its weights ({format_bytes(engine.weight_bytes)}) and "
                    f"workspace ({format_bytes(engine.workspace_bytes)}) come before the KV "
                    f"cache of one {self.seq_len}-token sequence "
                    f"({format_bytes(engine.sequence_kv_bytes)}){cure}"
                )
            return (
                f"rollout: the engine's {self.share:.0%} leaves no KV cache for one "
                f"{self.seq_len}-token sequence ({short} short){cure}"
            )
        for phase, over in self.over.items():
            return f"{phase}: {format_bytes(over)} over{cure}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "label": self.config.label(),
            "rollout_share": self.share,
            "sleep": self.sleep,
            "frozen": self.frozen.value,
            "micro_batch_size": self.micro_batch_size,
            "grad_accum": self.grad_accum,
            "fits": self.fits,
            "miss": self.miss,
            "max_share": self.max_share,
            "capacity_bytes": self.capacity_bytes,
            "phases": self.phases,
            "over_bytes": self.over,
            "parts": {k: dict(v) for k, v in self.parts.items()},
            "engine": self.engine.to_dict(),
            "seconds": {**self.seconds, "iteration": self.iteration_s},
            "samples_per_iteration": self.samples,
            "samples_per_second": self.samples_per_second,
            "tokens_per_second": self.tokens_per_second,
        }


def _states(model: ModelSpec, config: TrainConfig, world: int) -> int:
    """What a trained model keeps on a GPU between its steps."""
    layout = state_layout(model, config, world)
    return int(layout.parameters + layout.optimizer + layout.resident_buffers)


def _frozen_bytes(model: ModelSpec, config: TrainConfig, world: int) -> int:
    """A frozen model's weights on a GPU, in the compute dtype."""
    compute = config.precision.compute_bytes
    return compute * model.num_params // (world if sharded(config) else 1)


def _scoring_weights(
    model: ModelSpec, config: TrainConfig, world: int, seq_len: int, *, trained: bool
) -> float:
    """Weights a scoring forward holds beyond the model's resident ones, by its head: sharded
    over ranks, the gathered root unit (embeddings, final norm, head) and two blocks (the one
    at work and the one prefetched), in the compute dtype; FSDP2 without re-sharding keeps
    every gathered block; a trained model of an engine that autocasts per op, the copies of
    its weights autocast's cache keeps until the forward returns (as the training estimate
    counts them)."""
    compute = config.precision.compute_bytes
    per_layer = model.num_block_params / model.num_layers
    root = model.num_params - model.num_block_params
    if world > 1 and sharded(config):
        return compute * (root + 2 * per_layer)
    if world > 1 and config.engine is Engine.FSDP and trained:
        return compute * model.num_params  # ZeRO-2: gathered blocks stay gathered
    if not trained:
        return 0.0
    prof = activation_profile(model, config, seq_len)
    return model.num_layers * prof.layer_weight_copy_bytes + prof.head_weight_copy_bytes


def _forward_bytes(model: ModelSpec, tokens: int, logits: bool, copies: float = 0.0) -> int:
    """A scoring forward's transient at ``tokens`` tokens: a block's working set in bf16, or,
    once the blocks are done and their tensors freed, the head's: the final hidden state in
    fp32 and, for a model with a vocabulary head, its logits (:data:`SCORING_LOGIT_BYTES`;
    a value or reward head's output is a scalar a token), whichever is larger; plus
    ``copies``, the compute-dtype copies of the weights autocast keeps until the forward
    returns, or the sharded weights gathered for it (:func:`_scoring_weights`)."""
    d, i = model.hidden_size, model.intermediate_size
    block = tokens * (4 * d + 3 * i) * 2
    head = tokens * d * 4 + (tokens * model.vocab_size * SCORING_LOGIT_BYTES if logits else 0)
    return int(copies) + max(block, head)


@dataclass(frozen=True, kw_only=True, slots=True)
class _Trainer:
    """The trainer's side of an iteration at one micro-batch: what does not depend on the
    engine's layout."""

    config: TrainConfig
    micro_batch_size: int
    grad_accum: int
    states: int
    """The trained models' states kept between steps."""
    frozen: dict[str, int]
    """Each frozen model's weights on a GPU."""
    policy: MemoryEstimate
    training: int
    """The training phase's peak without the engine and the frozen models."""
    forward: int
    """The largest scoring forward's transient."""
    training_s: float
    scoring_s: float


def _trainer(
    work: RLHFWorkload, gpu: GpuSpec, config: TrainConfig, mbs: int, gpus_per_node: int
) -> _Trainer:
    models, world = work.models, work.world_size
    batch = Workload(seq_len=work.seq_len, global_batch=work.rollout_batch, world_size=world)
    accum = batch.grad_accum(mbs)
    trained = models.trained()
    states = {role: _states(m, config, world) for role, m in trained}
    peaks = {
        role: estimate_memory(
            m,
            config,
            micro_batch_size=mbs,
            seq_len=work.seq_len,
            world_size=world,
            cuda_allocator=caching_allocator(gpu),
            grad_accum=accum,  # each trained model steps over the rollout's micro-batches
        )
        for role, m in trained
    }
    # One trained model's training peak with the other's states beside it.
    training = max(
        peaks[role].device_bytes + sum(v for r, v in states.items() if r != role) for role in peaks
    )
    tokens = mbs * work.seq_len
    scorers = [
        (m, role == "policy", _scoring_weights(m, config, world, work.seq_len, trained=True))
        for role, m in trained
    ]
    scorers += [
        (m, role == "reference", _scoring_weights(m, config, world, work.seq_len, trained=False))
        for role, m in models.frozen()
    ]

    def step(model: ModelSpec, chosen: TrainConfig, grad_accum: int) -> StepTime:
        return predict_step_time(
            model,
            chosen,
            gpu,
            micro_batch_size=mbs,
            seq_len=work.seq_len,
            grad_accum=grad_accum,
            world_size=world,
            gpus_per_node=gpus_per_node,
        )

    forward_only = dataclasses.replace(config, ac_every=0)
    return _Trainer(
        config=config,
        micro_batch_size=mbs,
        grad_accum=accum,
        states=sum(states.values()),
        frozen={role: _frozen_bytes(m, config, world) for role, m in models.frozen()},
        policy=peaks["policy"],
        training=training,
        forward=max(_forward_bytes(m, tokens, logits, copies) for m, logits, copies in scorers),
        training_s=sum(step(m, config, accum).step_s for _, m in trained),
        # A forward is a third of a step's compute without recomputation.
        scoring_s=sum(step(m, forward_only, 1).compute_s / 3.0 * accum for m, _, _ in scorers),
    )


def _row(
    work: RLHFWorkload,
    gpu: GpuSpec,
    trainer: _Trainer,
    engine: EngineEstimate,
    rollout_s: float,
    *,
    sleep: bool,
    place: Placement,
    capacity: int,
) -> RLHFRow:
    """One layout at the trainer's micro-batch."""
    held = engine.asleep_bytes if sleep else engine.share_bytes
    resident = sum(trainer.frozen.values()) if place is Placement.RESIDENT else 0
    # An offloaded frozen model is on the GPU for its own forward only.
    loaded = 0 if place is Placement.RESIDENT else max(trainer.frozen.values(), default=0)
    link = gpu.host_link_bandwidth * HOST_COPY_EFFICIENCY
    switch = 2.0 * engine.weight_bytes / link if sleep else 0.0
    if place is Placement.OFFLOAD:
        switch += sum(trainer.frozen.values()) / link
    parts = {
        "rollout": {
            "engine": engine.share_bytes,
            "trained states": trainer.states,
            "frozen": resident,
        },
        "scoring": {
            "engine": held,
            "trained states": trainer.states,
            "frozen": resident + loaded,
            "forward": trainer.forward,
        },
        "training": {"engine": held, "frozen": resident, "training": trainer.training},
    }
    phases = {phase: sum(v.values()) for phase, v in parts.items()}
    return RLHFRow(
        config=trainer.config,
        share=engine.share,
        sleep=sleep,
        frozen=place,
        micro_batch_size=trainer.micro_batch_size,
        grad_accum=trainer.grad_accum,
        capacity_bytes=capacity,
        engine=engine,
        parts=parts,
        seconds={
            "rollout": rollout_s,
            "scoring": trainer.scoring_s,
            "training": trainer.training_s,
            "switch": switch,
        },
        samples=work.rollout_batch,
        seq_len=work.seq_len,
        max_share=_max_share(gpu, capacity, engine, phases, sleep),
        training=trainer.policy,
    )


def estimate_rlhf(
    work: RLHFWorkload,
    gpu: GpuSpec,
    config: TrainConfig,
    *,
    share: float,
    sleep: bool,
    frozen: Placement,
    micro_batch_size: int,
    gpus_per_node: int = 8,
    reserve: int = DEVICE_RESERVE_BYTES,
) -> RLHFRow:
    """One layout of the iteration at one micro-batch: each phase's memory and time."""
    engine = engine_estimate(work.models.policy, gpu, share, work.seq_len)
    return _row(
        work,
        gpu,
        _trainer(work, gpu, config, micro_batch_size, gpus_per_node),
        engine,
        rollout_seconds(work.models.policy, gpu, engine, work),
        sleep=sleep,
        place=frozen,
        capacity=usable_bytes(gpu, reserve=reserve),
    )


def plan_rlhf(
    work: RLHFWorkload,
    gpu: GpuSpec,
    *,
    shares: Iterable[float],
    sleeps: Iterable[bool] = (False, True),
    placements: Iterable[Placement] = tuple(Placement),
    engines: Iterable[Engine] | None = None,
    precision: Precision | None = None,
    offload: bool = True,
    gpus_per_node: int = 8,
    reserve: int = DEVICE_RESERVE_BYTES,
) -> list[RLHFRow]:
    """Every layout of the iteration, each at its best micro-batch, most samples per second
    first, then the nearest misses.

    Args:
        work: The models, lengths, rollout batch and GPUs.
        gpu: The GPU every rank has.
        shares: The engine shares to try.
        sleeps: Whether the engine sleeps during scoring and training (both by default).
        placements: Where the frozen models wait (both by default).
        engines: The trainer engines to try (all by default).
        precision: The trainer's precision (bf16-mixed where the GPU has bf16).
        offload: Include the trainer's CPU-offload configurations.
        gpus_per_node: GPUs sharing a node's fast links.
        reserve: Device bytes kept for the CUDA context (see DEVICE_RESERVE_BYTES).
    """
    models, world = work.models, work.world_size
    capacity = usable_bytes(gpu, reserve=reserve)
    batch = Workload(seq_len=work.seq_len, global_batch=work.rollout_batch, world_size=world)
    sizes = micro_batch_options(batch)
    engines_at = {s: engine_estimate(models.policy, gpu, s, work.seq_len) for s in shares}
    rollout_s = {s: rollout_seconds(models.policy, gpu, e, work) for s, e in engines_at.items()}
    sleeps, placements = tuple(sleeps), tuple(placements)  # walked once a configuration
    rows: list[RLHFRow] = []
    for config in configurations(
        world_size=world,
        num_layers=models.policy.num_layers,
        engines=engines,
        precision=precision or default_precision(gpu),
        attention=Attention.SDPA,
        offload=offload,
        knobs=LADDER_ONLY,
    ):
        trainers = [_trainer(work, gpu, config, mbs, gpus_per_node) for mbs in sizes]
        for share, sleep, place in itertools.product(engines_at, sleeps, placements):
            candidates = [
                _row(
                    work,
                    gpu,
                    trainer,
                    engines_at[share],
                    rollout_s[share],
                    sleep=sleep,
                    place=place,
                    capacity=capacity,
                )
                for trainer in trainers
            ]
            # A fitting size before any that does not, then the fastest; a layout that fits
            # nowhere is shown at its smallest miss (the first of equals, as sizes grow).
            rows.append(
                max(candidates, key=lambda r: (r.fits, r.samples_per_second, -sum(r.over.values())))
            )
    return sorted(rows, key=_rank)


def _rank(row: RLHFRow) -> tuple[float, ...]:
    """The plan's order: the layouts that fit by samples per second and, equally fast, the
    larger engine share first (its KV cache has room for longer responses than the planned
    length, which RL's sampling produces, at no predicted cost); then the misses, nearest
    first."""
    if row.fits:
        return (0, -round(row.samples_per_second, 6), -row.share, max(row.phases.values()))
    return (1, sum(row.over.values()), -(row.max_share or 0))


def _max_share(
    gpu: GpuSpec,
    capacity: int,
    engine: EngineEstimate,
    phases: dict[str, int],
    sleep: bool,
) -> float | None:
    """The largest share (in hundredths) at which the phases fit, and at which the engine
    still holds one sequence's KV cache; None when no share does."""
    # Each phase holding the engine's share grows with it byte for byte; the others do not.
    room = []
    for phase, used in phases.items():
        holds = phase == "rollout" or not sleep
        if holds:
            room.append(capacity - (used - engine.share_bytes))
        elif used > capacity:
            return None
    top = min(room) / gpu.memory_bytes
    needs = engine.weight_bytes + engine.workspace_bytes + engine.sequence_kv_bytes
    least = 0.0 if engine.emulated else needs / gpu.memory_bytes
    share = math.floor(top * 100) / 100
    if share < least or share <= 0:
        return None
    return min(share, 0.99)
