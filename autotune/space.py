"""The search space: every configuration worth trying on a number of GPUs, in ladder order.

The ladder (docs/architecture.md) climbs from the cheapest configuration to the costliest in
memory savings: no sharding, then the chunked loss (the logits never whole, for one more
forward of the output layer), then op-level selective checkpointing (matmul outputs kept, the
cheap ops recomputed), then block checkpointing coarse to fine, each with the chunked loss
after it, then heavier sharding, then CPU offload. :func:`ladder_key` orders
configurations that way; the planner, the search and the exports all enumerate the same
:func:`configurations`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from autotune.config import (
    PLANNED_KNOBS,
    Attention,
    ConfigError,
    Engine,
    Knobs,
    Loss,
    LossDtype,
    Offload,
    Optimizer,
    Precision,
    TrainConfig,
    parse_choice,
)

__all__ = [
    "JobEngine",
    "Workload",
    "ac_options",
    "configurations",
    "divisors",
    "ladder_key",
    "micro_batch_options",
    "oom_rules_out",
]


MAX_GLOBAL_BATCH = 1 << 24
"""The largest global batch taken (16,777,216 sequences: far above any published run's, whose
global batches are thousands of sequences, and still quick to factor)."""


@dataclass(frozen=True, slots=True)
class JobEngine:
    """An engine a user's job trains under when autotune asks for it, as its probes measured:
    DeepSpeed at one ZeRO stage, FSDP at either reshard mode (the measurement layer cannot
    tell them apart), at one rank no wrapper and DDP alike (a lone rank's DDP exchanges
    nothing, and frameworks differ on wrapping it)."""

    engine: Engine
    zero_stage: int | None = None
    """DeepSpeed's ZeRO stage; None for the other engines."""

    def covers(self, config: TrainConfig, world_size: int) -> bool:
        """Whether ``config`` asks for this engine (on ``world_size`` ranks)."""
        return self.alike(JobEngine.of(config.engine, config.zero_stage), world_size)

    def alike(self, other: JobEngine, world_size: int) -> bool:
        """Whether the two are one engine on ``world_size`` ranks."""
        return self._key(world_size) == other._key(world_size)

    def _key(self, world_size: int) -> tuple[str, int | None]:
        if world_size == 1 and self.engine in (Engine.SINGLE, Engine.DDP):
            return "single or ddp", None
        return self.engine.value, self.zero_stage

    def text(self, world_size: int) -> str:
        """How a run's line names it: ``deepspeed z2``, ``fsdp``, ``single or ddp``."""
        name, stage = self._key(world_size)
        return name if stage is None else f"{name} z{stage}"

    @classmethod
    def of(cls, engine: Engine | str, zero_stage: int | None) -> JobEngine:
        """The engine as trained: the stage kept for DeepSpeed alone."""
        engine = Engine(engine)
        return cls(engine, int(zero_stage or 0) if engine is Engine.DEEPSPEED else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What the user trains and on how many GPUs: fixed for a whole search."""

    seq_len: int
    """Tokens per sequence."""
    global_batch: int
    """Sequences per optimizer step over all ranks."""
    world_size: int
    """Ranks (GPUs) in all; with a layout, :attr:`data_parallel` of them share the batch."""
    loss_dtype: LossDtype = LossDtype.FP32
    """The dtype the job's loss takes the logits in: the stand-in's and every export's is
    fp32 (the model's own loss); a user's job's is measured by its first probe."""
    one_rank_engine: Engine | None = None
    """The engine a user's job trains under at one rank, whether a configuration asks for one
    process or DDP (the Trainer and accelerate launched by torchrun wrap a lone rank in DDP,
    with its gradient buckets; a plain loop may not): measured by a probe. None: as asked."""
    model_parallel: int = 1
    """Ranks of one replica's tensor, pipeline and context parallel groups, where a run keeps
    one layout (``run --tp 2``): the global batch is shared by the data-parallel ranks, the
    GPUs over it. 1: data parallelism alone."""
    job_engines: tuple[JobEngine, ...] | None = None
    """The engines a user's job trains under when asked, where a probe found it training
    under another engine than the one asked (its own wrapper): the configurations of the
    others are not tried (:func:`configurations`). None: every engine, as asked."""

    def __post_init__(self) -> None:
        chosen = parse_choice(LossDtype, self.loss_dtype, "loss dtype")
        object.__setattr__(self, "loss_dtype", chosen)
        engine = parse_choice(Engine, self.one_rank_engine, "engine")
        if engine not in (None, Engine.SINGLE, Engine.DDP):
            raise ConfigError(f"a lone rank trains with no wrapper or DDP, not {engine}")
        object.__setattr__(self, "one_rank_engine", engine)
        if self.job_engines is not None:
            object.__setattr__(self, "job_engines", tuple(self.job_engines))
        for name in ("seq_len", "global_batch", "world_size", "model_parallel"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be at least 1")
        if self.world_size % self.model_parallel:
            raise ConfigError(
                f"a layout of {self.model_parallel} ranks does not divide {self.world_size} "
                "GPUs: use degrees whose product divides the GPUs"
            )
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise ConfigError(
                f"global batch {self.global_batch:,} is more sequences per step than any "
                f"training run takes: use {MAX_GLOBAL_BATCH:,} or fewer"
            )

    def job_engines_text(self) -> str:
        """:attr:`job_engines` as a run's line names them (``fsdp, deepspeed z2``)."""
        engines = self.job_engines or ()
        return ", ".join(dict.fromkeys(e.text(self.world_size) for e in engines)) or "none"

    def job_engines_unsearched(self, found: str) -> str:
        """The line that refuses a run whose space holds none of :attr:`job_engines`
        (``found``: where they were found), with the ``--engine`` to give."""
        flags = " or ".join(dict.fromkeys(e.engine.value for e in self.job_engines or ()))
        return (
            f"the job trains under {self.job_engines_text()} alone ({found}), which this run "
            f"does not search: use --engine {flags or 'none'}"
        )

    def as_trained(self, config: TrainConfig) -> TrainConfig:
        """``config`` as the job trains it: at one rank, one process or DDP as the job wraps
        it (:attr:`one_rank_engine`); otherwise as asked."""
        engine = self.one_rank_engine
        if (
            engine is None
            or self.world_size != 1
            or config.engine not in (Engine.SINGLE, Engine.DDP)
            or config.engine is engine
        ):
            return config
        return dataclasses.replace(config, engine=engine)

    @property
    def splits_evenly(self) -> bool:
        """Whether every data-parallel rank takes as many sequences of the global batch (a
        plan's layouts, with fewer data-parallel ranks than GPUs, need less)."""
        return self.global_batch % self.data_parallel == 0

    @property
    def data_parallel(self) -> int:
        """The ranks that share the global batch: the GPUs over :attr:`model_parallel`."""
        return self.world_size // self.model_parallel

    def check_splits(self) -> None:
        """Refuse a global batch the data-parallel ranks cannot share evenly, in one line."""
        if not self.splits_evenly:
            ranks = self.data_parallel
            what = f"{ranks} GPUs" if ranks == self.world_size else f"{ranks} data-parallel ranks"
            raise ConfigError(
                f"global batch {self.global_batch} is not a multiple of {what}: use a global "
                f"batch divisible by {ranks}"
            )

    @property
    def per_rank_batch(self) -> int:
        """Sequences each data-parallel rank processes per optimizer step."""
        self.check_splits()
        return self.global_batch // self.data_parallel

    def grad_accum(self, micro_batch_size: int) -> int:
        """Micro-steps per optimizer step so that mbs × ranks × accumulation = global batch."""
        if self.per_rank_batch % micro_batch_size:
            raise ConfigError(
                f"micro-batch {micro_batch_size} does not divide the {self.per_rank_batch} "
                "sequences per rank: pick a divisor"
            )
        return self.per_rank_batch // micro_batch_size


def oom_rules_out(failed: int, mbs: int, accumulation: Callable[[int], int]) -> bool:
    """Whether an OOM at micro-batch ``failed`` means ``mbs`` runs out of memory too, where
    ``accumulation`` gives each size's micro-steps per optimizer step.

    Memory grows with the micro-batch, but a size that accumulates keeps the earlier
    micro-steps' gradients through the next forward, and a size trained in one micro-step
    (the whole per-rank batch) keeps none: an OOM of an accumulating size rules out the larger
    accumulating sizes only (FSDP2 keeps 4 bytes a parameter of unsharded gradients between
    micro-steps, more than a micro-batch's activations)."""
    return mbs >= failed and (accumulation(mbs) > 1 or accumulation(failed) == 1)


def micro_batch_options(workload: Workload, limit: int | None = None) -> list[int]:
    """Micro-batch sizes that reach the global batch exactly: divisors of the per-rank batch."""
    return [m for m in divisors(workload.per_rank_batch) if limit is None or m <= limit]


def divisors(number: int) -> list[int]:
    """The divisors of ``number``, ascending (found up to its square root, each with its
    co-divisor)."""
    small = [m for m in range(1, math.isqrt(number) + 1) if number % m == 0]
    return sorted({*small, *(number // m for m in small)})


def ac_options(num_layers: int) -> list[int]:
    """Checkpointing choices, coarse to fine: off, every 4th, every 2nd, every block."""
    return [0, *(k for k in (4, 2) if k < num_layers), 1]


def _sharding(world_size: int) -> Iterator[tuple[Engine, int, Offload]]:
    """(engine, stage, offload) combinations that make sense on ``world_size`` GPUs."""
    if world_size == 1:
        yield Engine.SINGLE, 0, Offload.NONE
    else:
        yield Engine.DDP, 0, Offload.NONE
        yield Engine.FSDP, 2, Offload.NONE
        yield Engine.FSDP, 3, Offload.NONE
        for stage in (1, 2, 3):
            yield Engine.DEEPSPEED, stage, Offload.NONE
    # Offload helps on one GPU as well: the host takes the optimizer (and the weights).
    for stage in (1, 2, 3) if world_size > 1 else (2, 3):
        yield Engine.DEEPSPEED, stage, Offload.OPTIMIZER
    yield Engine.DEEPSPEED, 3, Offload.PARAMS
    yield Engine.FSDP, 3, Offload.PARAMS


def configurations(
    *,
    world_size: int,
    num_layers: int,
    engines: Iterable[Engine] | None = None,
    precision: Precision = Precision.BF16_MIXED,
    attention: Attention = Attention.SDPA,
    offload: bool = True,
    knobs: Knobs = PLANNED_KNOBS,
    job_engines: Iterable[JobEngine] | None = None,
) -> list[TrainConfig]:
    """Every valid configuration for ``world_size`` GPUs, sorted in ladder order.

    Args:
        world_size: Data-parallel ranks.
        num_layers: Decoder blocks (bounds the checkpointing choices).
        engines: Restrict to these engines (``--engine``); the plain engines (single, ddp)
            stay in as the no-sharding rung unless excluded by naming others only.
        precision: The user's precision (bf16-mixed unless the GPU lacks bf16).
        attention: The attention kernel.
        offload: Include the CPU-offload rungs (not where there is no host to offload to,
            as on a CPU emulating a device).
        knobs: The knobs beyond the ladder to try (:data:`autotune.config.LADDER_ONLY` for a
            user's script, which computes its loss, checkpoints and builds its optimizer
            itself).
        job_engines: The engines a user's job trains under when asked
            (:attr:`Workload.job_engines`): the others' configurations are left out, and on
            one GPU a sharding engine's are tried without offload too (a job that always
            shards its model does so on one GPU as well); None: every engine.

    Returns:
        Configurations, cheapest rung first.
    """
    allowed = set(engines) if engines is not None else set(Engine)
    trained = None if job_engines is None else list(job_engines)
    sharding = list(_sharding(world_size))
    if trained is not None and world_size == 1:
        sharding[1:1] = [
            (e.engine, 3 if e.zero_stage is None else e.zero_stage, Offload.NONE)
            for e in trained
            if e.engine in (Engine.FSDP, Engine.DEEPSPEED)
        ]
    found: list[TrainConfig] = []
    for engine, stage, where in dict.fromkeys(sharding):
        if engine not in allowed or (where is not Offload.NONE and not offload):
            continue
        if trained is not None and not any(
            e.alike(JobEngine.of(engine, stage), world_size) for e in trained
        ):
            continue
        checkpointing = [
            (ac, False)
            for ac in ac_options(num_layers)
            if (knobs.block_patterns or ac in (0, 1)) and (knobs.block_checkpointing or ac == 0)
        ]
        if knobs.op_checkpointing and knobs.block_checkpointing:
            checkpointing.insert(1, (0, True))
        # Activation offload (on the CPU, to an emulated host pool the probe counts apart).
        moved = (False, True) if knobs.activation_offload else (False,)
        for (ac, ops), loss, optimizer, act in itertools.product(
            checkpointing, knobs.losses, knobs.optimizers, moved
        ):
            try:
                found.append(
                    TrainConfig(
                        engine=engine,
                        zero_stage=stage,
                        precision=precision,
                        ac_every=ac,
                        ac_ops=ops,
                        offload=where,
                        attention=attention,
                        loss=loss,
                        optimizer=optimizer,
                        act_offload=act,
                    )
                )
            except ConfigError:
                continue  # e.g. fp16 with FSDP2, pure bf16 with DeepSpeed
        if knobs.lora_rank and engine in (Engine.SINGLE, Engine.DDP) and where is Offload.NONE:
            found += _lora(engine, num_layers, precision, attention, knobs)
    if not found and engines is not None and trained is None:
        usable = {
            e.value for e, _, where in _sharding(world_size) if offload or where is Offload.NONE
        }
        named = ",".join(sorted(e.value for e in allowed))
        gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
        raise ConfigError(
            f"--engine {named} leaves no configuration on {gpus}"
            f"{'' if offload else ' without offload'}: use --engine "
            f"{' or '.join(sorted(usable))}"
        )
    return sorted(found, key=ladder_key)


def _lora(
    engine: Engine, num_layers: int, precision: Precision, attention: Attention, knobs: Knobs
) -> list[TrainConfig]:
    """LoRA on a plain engine at each checkpointing choice, with the model's own loss (the
    one it is modelled with)."""
    return [
        TrainConfig(
            engine=engine,
            precision=precision,
            ac_every=ac,
            attention=attention,
            lora_rank=knobs.lora_rank,
        )
        for ac in ac_options(num_layers)
    ]


_OFFLOAD_RANK = {Offload.NONE: 0, Offload.OPTIMIZER: 1, Offload.PARAMS: 2}


def ladder_key(config: TrainConfig) -> tuple[int, int, int, int, int, int, int, int]:
    """Sort key of the ladder: LoRA last (it trains another model), then offload, then
    sharding, then checkpointing (coarse first, with op-level checkpointing between none and
    every 4th block: it recomputes only the cheap ops), the chunked loss right after the same
    configuration with the model's own (it costs one more forward of the output layer, less
    than any checkpointing), 8-bit AdamW right after the same configuration with fused AdamW
    (it changes the moments' precision, and its step is no faster), activation offload right
    after the same configuration without it (its copies cross the host link)."""
    blocks = 0 if config.ac_every == 0 else 1 + 4 // config.ac_every
    ac_rank = 2 * blocks + int(config.ac_ops)
    return (
        int(config.is_lora),
        _OFFLOAD_RANK[config.offload],
        config.zero_stage,
        ac_rank,
        int(config.loss is not Loss.FULL),
        int(config.optimizer is not Optimizer.ADAMW),
        int(config.act_offload),
        int(config.engine is Engine.DEEPSPEED),
    )
