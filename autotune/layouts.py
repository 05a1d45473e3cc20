"""Layouts beyond data parallelism: tensor (TP), pipeline (PP) and context (CP) parallel
degrees, checked against a world and a model, and the layouts a plan considers.

A configuration's layout is its own fields (:class:`autotune.config.TrainConfig`: ``tp``,
``pp``, ``pp_schedule``, ``pp_virtual``, ``cp``); the data-parallel degree is what is left of
the world, ``world / (tp * pp * cp)``, over which FSDP2 shards the model states (with the
context-parallel ranks, as torchtitan's ``dp_shard_cp`` mesh does) or DDP replicates them.
Rules that need only the configuration are :class:`TrainConfig`'s; those that need the world,
the node or the model are :func:`check_layout`'s, the one place they are made. Every rule's
message names the option and what to do.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from autotune.config import Attention, ConfigError, Engine, Precision, Schedule, TrainConfig
from autotune.models import ModelSpec

__all__ = [
    "MIN_CP_TOKENS",
    "LayoutOptions",
    "check_layout",
    "chunk_bounds",
    "data_parallel",
    "in_flight",
    "layout_configs",
    "layout_engine_refusal",
    "pipeline_microbatches_ok",
    "shard_model",
    "stage_layers",
    "without_layout",
]

MIN_CP_TOKENS = 4096
"""The fewest tokens of a sequence a context-parallel rank is planned with: below, a ring
step's key/value exchange outlasts the attention block it hides behind (the published
long-context runs keep 8-16k tokens a rank: Llama 3's 128k context over CP 16, Dubey et al.
2024, "The Llama 3 Herd of Models", section 3.3.2)."""

MAX_PP = 32
"""The most pipeline stages a plan considers."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayoutOptions:
    """Which TP/PP/CP layouts a plan ranks beside the data-parallel configurations: the
    degrees the user named (None: every degree :func:`layout_configs` considers), and whether
    TP may span nodes."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    tp_across_nodes: bool = False

    @property
    def named(self) -> bool:
        """Whether the user named a degree above 1 (``--tp 8``): layouts asked for."""
        return any(d is not None and set(d) != {1} for d in (self.tp, self.pp, self.cp))


def layout_flags(config: TrainConfig) -> list[str]:
    """A layout's degrees as ``run`` and ``probe`` take them, each option then its value
    (``--tp 2 --pp 2 --pp-schedule 1f1b``); empty for data parallelism."""
    named = {"tp": config.tp, "pp": config.pp, "cp": config.cp}
    words = [
        word for name, degree in named.items() if degree > 1 for word in (f"--{name}", str(degree))
    ]
    if config.pp > 1:
        words += ["--pp-schedule", config.pp_schedule.value]
        if config.pp_virtual > 1:
            words += ["--pp-virtual", str(config.pp_virtual)]
    return words


def data_parallel(config: TrainConfig, world_size: int) -> int:
    """Ranks that each hold a whole replica's share of the work: the world over ``tp * pp * cp``
    (:func:`check_layout` has made sure it divides)."""
    return world_size // config.model_parallel


def _analytic(model: ModelSpec) -> None:
    if model.model_type == "gpt2":
        raise ConfigError(
            f"{model.name} is a GPT-2, whose head width follows its head count: tensor, "
            "pipeline and context parallel layouts are planned for llama-style models "
            "(llama, mistral, qwen2)"
        )


def check_layout(
    config: TrainConfig,
    model: ModelSpec,
    *,
    world_size: int,
    gpus_per_node: int,
    seq_len: int,
    tp_across_nodes: bool = False,
) -> None:
    """Refuse a layout the world, the node or the model cannot hold, in one line that says
    what to do: degrees that do not divide the world; TP across nodes unless asked; heads or
    key/value heads that do not split over TP; fewer layers than pipeline chunks (a stage may
    hold a layer more than another, as torchtitan and Megatron-LM split them); a sequence
    that does not split into ``2 * cp`` chunks (the load-balanced causal ring of Liu et al.
    2023, as torch's ``context_parallel`` runs it); the plain engine where data-parallel or
    context-parallel ranks share the states."""
    if not config.is_layout:
        return
    _analytic(model)
    degrees = f"--tp {config.tp} x --pp {config.pp} x --cp {config.cp}"
    if world_size % config.model_parallel:
        raise ConfigError(
            f"{degrees} = {config.model_parallel} ranks do not divide {world_size} GPUs: "
            "use degrees whose product divides the GPUs"
        )
    if (
        config.tp > 1
        and not tp_across_nodes
        and (config.tp > gpus_per_node or gpus_per_node % config.tp)
    ):
        raise ConfigError(
            f"--tp {config.tp} does not fit in a node of {gpus_per_node} GPUs (its collectives "
            "run every layer): use a divisor of the GPUs a node, or --tp-across-nodes"
        )
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if heads % config.tp or kv % config.tp:
        raise ConfigError(
            f"--tp {config.tp}: {model.name}'s {heads} attention heads and {kv} key/value "
            f"heads do not split over {config.tp} ranks: use a divisor of {_gcd(heads, kv)}"
        )
    chunks = config.pp * config.pp_virtual
    layers = model.num_layers
    if layers < chunks:
        what = "stages" if config.pp_virtual == 1 else "stages x virtual stages"
        raise ConfigError(
            f"--pp {config.pp}"
            + (f" x --pp-virtual {config.pp_virtual}" if config.pp_virtual > 1 else "")
            + f" = {chunks} {what} are more than {model.name}'s {layers} layers: use "
            f"{layers} or fewer"
        )
    if seq_len % (2 * config.cp):
        raise ConfigError(
            f"--cp {config.cp}: a sequence of {seq_len} tokens does not split into "
            f"{2 * config.cp} equal chunks (two a rank, for causal load balance): use a "
            f"sequence length divisible by {2 * config.cp}"
        )
    if config.engine is Engine.SINGLE and data_parallel(config, world_size) * config.cp > 1:
        raise ConfigError(
            f"{data_parallel(config, world_size)} data-parallel ranks and {config.cp} context "
            f"ranks share the states over {degrees}: use --engine fsdp or ddp for them"
        )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def pipeline_microbatches_ok(config: TrainConfig, microbatches: int) -> bool:
    """Whether a step of ``microbatches`` can run the pipeline's schedule: at least one a
    stage (1F1B fills the pipeline with ``pp``), and a multiple of the stages under the
    interleaved schedule (Megatron-LM's rule)."""
    if config.pp == 1:
        return True
    if microbatches < config.pp:
        return False
    return config.pp_schedule is not Schedule.INTERLEAVED_1F1B or microbatches % config.pp == 0


def in_flight(config: TrainConfig, microbatches: int, *, last: bool = False) -> float:
    """Microbatches whose activations the first pipeline stage (or with ``last``, the last)
    holds at once: all of them under GPipe, on every stage; on the first, ``min(pp, m)``
    under 1F1B, 1F1B's times ``1 + (pp - 1) / (pp * v)`` under the interleaved schedule
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4.2.3, as Megatron-LM's theoretical memory counts it), and one on the
    last (its backward follows each forward). 1 without a pipeline."""
    if config.pp == 1:
        return 1.0
    if config.pp_schedule is Schedule.GPIPE:
        return float(microbatches)
    if last:
        return 1.0
    held = float(min(config.pp, microbatches))
    if config.pp_schedule is Schedule.INTERLEAVED_1F1B:
        held *= 1.0 + (config.pp - 1) / (config.pp * config.pp_virtual)
    return held


def shard_model(model: ModelSpec, config: TrainConfig) -> ModelSpec:
    """One rank's share of ``model`` under the layout: the most loaded pipeline rank's blocks
    (:func:`stage_layers`), each with ``1 / tp`` of its attention heads, key/value heads and MLP
    width, and one vocabulary table of ``vocab / tp`` rows (the first stage's embedding or the last
    stage's output layer; both, tied as the model ties them, without a pipeline). The head width is
    kept, so the parameter and FLOP counts are the shard's."""
    return _shard(model, config.tp, config.pp, config.pp_virtual)


@functools.lru_cache(maxsize=256)
def _shard(model: ModelSpec, tp: int, pp: int, virtual: int) -> ModelSpec:
    """:func:`shard_model`'s, once per model and degrees (a plan asks thousands of times, and
    the shard memoizes its own counts)."""
    _analytic(model)
    fields = model.config_dict()
    fields["num_hidden_layers"] = stage_layers(model.num_layers, pp, virtual)
    fields["num_attention_heads"] = max(1, model.num_attention_heads // tp)
    fields["num_key_value_heads"] = max(1, model.num_key_value_heads // tp)
    fields["head_dim"] = model.head_dim
    fields["intermediate_size"] = max(1, -(-model.intermediate_size // tp))
    fields["vocab_size"] = max(1, -(-model.vocab_size // tp))
    if pp > 1:
        fields["tie_word_embeddings"] = True  # a stage holds one of the two tables
    layer_types = fields.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        fields["layer_types"] = layer_types[: fields["num_hidden_layers"]]
    return ModelSpec(name=model.name, config=fields)


def chunk_bounds(layers: int, chunks: int) -> list[range]:
    """The blocks of each pipeline chunk: consecutive, the first ``layers % chunks`` chunks a
    block more (the probe's split, and every export's)."""
    size, extra = divmod(layers, chunks)
    bounds, start = [], 0
    for index in range(chunks):
        end = start + size + (1 if index < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


def stage_layers(layers: int, pp: int, virtual: int = 1) -> int:
    """The blocks of the most loaded pipeline rank: ``virtual`` chunks of ``layers / (pp *
    virtual)`` blocks, rounded up where they do not split evenly."""
    return -(-layers // (pp * virtual)) * virtual


def _powers_of_two(limit: int) -> Iterator[int]:
    value = 1
    while value <= limit:
        yield value
        value *= 2


def layout_configs(
    model: ModelSpec,
    *,
    world_size: int,
    gpus_per_node: int,
    seq_len: int,
    precision: Precision = Precision.BF16_MIXED,
    attention: Attention = Attention.SDPA,
    engines: Iterable[Engine] | None = None,
    tp: Sequence[int] | None = None,
    pp: Sequence[int] | None = None,
    cp: Sequence[int] | None = None,
    tp_across_nodes: bool = False,
) -> list[TrainConfig]:
    """The TP/PP/CP layouts a plan ranks beside the data-parallel configurations.

    TP: powers of two inside a node that split the heads and key/value heads. PP: up to
    :data:`MAX_PP` stages (a stage may hold a layer more than another), under 1F1B, and
    interleaved with two chunks a rank where there are layers enough (GPipe is left out: the
    same bubble as 1F1B with every microbatch's activations held). CP: powers of two that
    leave each rank at least :data:`MIN_CP_TOKENS` tokens. The data-parallel rest under FSDP2
    (ZeRO-2 or ZeRO-3), or the plain engine where there is none; checkpointing off, every
    block, or op-level. The user's ``tp``, ``pp`` and ``cp`` restrict the degrees (each still
    checked); a model whose family is not llama-style has none.
    """
    named = any(d is not None and set(d) != {1} for d in (tp, pp, cp))
    if not named and (model.model_type == "gpt2" or world_size == 1):
        return []
    allowed = set(engines) if engines is not None else set(Engine)
    node = world_size if tp_across_nodes else min(gpus_per_node, world_size)
    tps = list(tp) if tp is not None else list(_powers_of_two(node))
    pps = list(pp) if pp is not None else [p for p in range(1, min(MAX_PP, model.num_layers) + 1)]
    cps = (
        list(cp)
        if cp is not None
        else [c for c in _powers_of_two(world_size) if c == 1 or seq_len // c >= MIN_CP_TOKENS]
    )
    if named:
        for name, values in (("tp", tp), ("pp", pp), ("cp", cp)):
            for value in values or ():
                degrees: dict[str, Any] = {name: value}
                alone = TrainConfig(engine=Engine.FSDP, zero_stage=3, **degrees)
                check_layout(
                    alone,
                    model,
                    world_size=world_size,
                    gpus_per_node=gpus_per_node,
                    seq_len=seq_len,
                    tp_across_nodes=tp_across_nodes,
                )
    found: list[TrainConfig] = []
    for t, p, c in itertools.product(tps, pps, cps):
        if t * p * c == 1 or world_size % (t * p * c):
            continue
        dp = world_size // (t * p * c)
        shared = dp * c > 1  # the states' gradients meet over the data and context ranks
        sharding = [(Engine.FSDP, 2), (Engine.FSDP, 3)] if shared else [(Engine.SINGLE, 0)]
        schedules = [(Schedule.ONE_F_ONE_B, 1)]
        if p > 1 and model.num_layers >= 2 * p:
            schedules.append((Schedule.INTERLEAVED_1F1B, 2))
        for (engine, stage), (schedule, virtual), (ac, ops) in itertools.product(
            sharding, schedules, ((0, False), (0, True), (1, False))
        ):
            if engine is not Engine.SINGLE and engine not in allowed:
                continue
            try:
                config = TrainConfig(
                    engine=engine,
                    zero_stage=stage,
                    precision=precision,
                    attention=attention,
                    ac_every=ac,
                    ac_ops=ops,
                    tp=t,
                    pp=p,
                    pp_schedule=schedule,
                    pp_virtual=virtual,
                    cp=c,
                )
                check_layout(
                    config,
                    model,
                    world_size=world_size,
                    gpus_per_node=gpus_per_node,
                    seq_len=seq_len,
                    tp_across_nodes=tp_across_nodes,
                )
            except ConfigError:
                continue  # e.g. FSDP2 in fp16, a degree that does not split the layers
            found.append(config)
    if named and not found:
        for t, p, c in itertools.product(tps, pps, cps):
            refusal = layout_engine_refusal(t, p, c, world_size, engines)
            if refusal is not None and t * p * c > 1 and world_size % (t * p * c) == 0:
                raise ConfigError(refusal)  # the degrees fit: the engines named do not
        raise ConfigError(
            f"no layout of the degrees named (--tp, --pp, --cp) runs on {world_size} GPUs: "
            "use degrees whose product divides the GPUs"
        )
    return found


def layout_engine_refusal(
    tp: int, pp: int, cp: int, world_size: int, engines: Iterable[Engine] | None
) -> str | None:
    """Why ``engines`` (``--engine``) leave no layout of these degrees on ``world_size``
    GPUs, in one line, or None: a layout's data-parallel rest (and its context ranks) shard
    under FSDP2 (where the degrees take every GPU, no engine is over them: any will do)."""
    if engines is None or world_size % (tp * pp * cp):
        return None
    allowed = set(map(Engine, engines))
    dp = world_size // (tp * pp * cp)
    degrees = " ".join(
        f"--{name} {value}" for name, value in (("tp", tp), ("pp", pp), ("cp", cp)) if value > 1
    )
    named = ",".join(sorted(e.value for e in allowed))
    if dp * cp > 1 and Engine.FSDP not in allowed:
        return (
            f"{degrees} on {world_size} GPUs shards the rest of each replica's ranks under "
            f"FSDP2, which --engine {named} leaves out: use --engine fsdp"
        )
    return None


def without_layout(config: TrainConfig) -> TrainConfig:
    """``config`` with data parallelism alone: what each rank runs on its shard."""
    if not config.is_layout:
        return config
    return dataclasses.replace(
        config, tp=1, pp=1, cp=1, pp_schedule=Schedule.ONE_F_ONE_B, pp_virtual=1
    )
