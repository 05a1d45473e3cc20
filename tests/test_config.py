"""Tests for autotune.config: validation rules, enum coercion, dict round trip, parse_ac."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from typing import Any

import pytest

from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Loss,
    Offload,
    Precision,
    TrainConfig,
    ac_to_text,
    parse_ac,
    parse_ac_ops,
    parse_losses,
)

# The supported combinations, written out independently of the validation code.
SUPPORTED_STAGES = {
    Engine.SINGLE: {0},
    Engine.DDP: {0},
    Engine.FSDP: {2, 3},
    Engine.DEEPSPEED: {0, 1, 2, 3},
}


def _expected_valid(engine: Engine, stage: int, offload: Offload, precision: Precision) -> bool:
    if stage not in SUPPORTED_STAGES[engine]:
        return False
    if engine in (Engine.SINGLE, Engine.DDP) and offload is not Offload.NONE:
        return False
    if engine is Engine.FSDP and (
        offload is Offload.OPTIMIZER or precision is Precision.FP16_MIXED
    ):
        return False
    if engine is Engine.DEEPSPEED:
        if precision is Precision.BF16:
            return False
        if offload is Offload.OPTIMIZER and stage == 0:
            return False
        if offload is Offload.PARAMS and stage != 3:
            return False
    return True


ALL_COMBINATIONS = list(itertools.product(Engine, range(4), Offload, Precision))


def _combo_id(combo: tuple[Engine, int, Offload, Precision]) -> str:
    engine, stage, offload, precision = combo
    return f"{engine.value}-z{stage}-{offload.value}-{precision.value}"


@pytest.mark.parametrize("combo", ALL_COMBINATIONS, ids=[_combo_id(c) for c in ALL_COMBINATIONS])
def test_combination_accepted_or_rejected_with_a_fix(
    combo: tuple[Engine, int, Offload, Precision],
) -> None:
    """Each engine x stage x offload x precision is accepted exactly when it is supported;
    a rejection is a ConfigError (a ValueError) whose message names a command-line fix."""
    engine, stage, offload, precision = combo
    kwargs: dict[str, Any] = {
        "engine": engine,
        "zero_stage": stage,
        "offload": offload,
        "precision": precision,
    }
    if _expected_valid(*combo):
        config = TrainConfig(**kwargs)
        assert (config.engine, config.zero_stage, config.offload) == (engine, stage, offload)
        return
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**kwargs)
    assert isinstance(caught.value, ValueError)
    assert "--" in str(caught.value), f"no fix named in: {caught.value}"


_FLAG = re.compile(r"--(engine|zero-stage|offload|precision) ([\w.-]+)")


@pytest.mark.parametrize(
    "combo",
    [c for c in ALL_COMBINATIONS if not _expected_valid(*c)],
    ids=[_combo_id(c) for c in ALL_COMBINATIONS if not _expected_valid(*c)],
)
def test_following_the_suggested_fix_reaches_a_valid_config(
    combo: tuple[Engine, int, Offload, Precision],
) -> None:
    """Applying the first flag each error message suggests reaches a valid config."""
    engine, stage, offload, precision = combo
    kwargs: dict[str, Any] = {
        "engine": engine.value,
        "zero_stage": stage,
        "offload": offload.value,
        "precision": precision.value,
    }
    for _ in range(5):  # each message names one fix; at most four are needed
        try:
            TrainConfig(**kwargs)
            return
        except ConfigError as error:
            match = _FLAG.search(str(error))
            assert match, f"no flag to follow in: {error}"
            name, value = match.group(1).replace("-", "_"), match.group(2)
            kwargs[name] = int(value) if name == "zero_stage" else value
    pytest.fail(f"still invalid after following four fixes: {kwargs}")


@pytest.mark.parametrize(
    ("engine", "stage"),
    [("single", 1), ("ddp", 2), ("fsdp", 0), ("fsdp", 1), ("deepspeed", 4), ("deepspeed", -1)],
)
def test_zero_stage_out_of_range_lists_the_valid_stages(engine: str, stage: int) -> None:
    """A stage the engine does not have is rejected with the stages it takes."""
    with pytest.raises(ConfigError) as caught:
        TrainConfig(engine=engine, zero_stage=stage)  # type: ignore[arg-type]
    message = str(caught.value)
    valid = ", ".join(map(str, sorted(SUPPORTED_STAGES[Engine(engine)])))
    assert f"(it takes {valid})" in message
    assert f"zero stage {stage}" in message


@pytest.mark.parametrize("ac_every", [0, 1, 2, 3, 100])
def test_ac_every_accepted(ac_every: int) -> None:
    """Activation checkpointing off, every block or every k-th block."""
    assert TrainConfig(ac_every=ac_every).ac_every == ac_every


@pytest.mark.parametrize("ac_every", [-1, -5])
def test_ac_every_negative_rejected(ac_every: int) -> None:
    """A negative checkpointing interval is rejected with the accepted spellings."""
    with pytest.raises(ConfigError, match="use off, every, or N >= 1"):
        TrainConfig(ac_every=ac_every)


def test_defaults() -> None:
    """The default is one process, no sharding, bf16-mixed, no checkpointing, sdpa."""
    config = TrainConfig()
    assert config.engine is Engine.SINGLE
    assert config.zero_stage == 0
    assert config.precision is Precision.BF16_MIXED
    assert config.ac_every == 0
    assert config.offload is Offload.NONE
    assert config.attention is Attention.SDPA
    assert not config.is_distributed


def test_enum_coercion_from_strings() -> None:
    """Plain strings (JSON, CLI, Optuna) become the enum members."""
    config = TrainConfig(
        engine="deepspeed",  # type: ignore[arg-type]
        zero_stage=3,
        precision="fp16-mixed",  # type: ignore[arg-type]
        offload="params",  # type: ignore[arg-type]
        attention="eager",  # type: ignore[arg-type]
    )
    assert config.engine is Engine.DEEPSPEED
    assert config.precision is Precision.FP16_MIXED
    assert config.offload is Offload.PARAMS
    assert config.attention is Attention.EAGER
    assert config.is_distributed
    assert config == TrainConfig(
        engine=Engine.DEEPSPEED,
        zero_stage=3,
        precision=Precision.FP16_MIXED,
        offload=Offload.PARAMS,
        attention=Attention.EAGER,
    )


@pytest.mark.parametrize(
    ("field", "value", "choices"),
    [
        ("engine", "megatron", "single, ddp, fsdp, deepspeed"),
        ("precision", "fp8", "bf16-mixed, bf16, fp16-mixed, fp32"),
        ("offload", "nvme", "none, optimizer, params"),
        ("attention", "flash", "sdpa, eager"),
        ("engine", "DDP", "single, ddp, fsdp, deepspeed"),  # values are case-sensitive
    ],
)
def test_unknown_enum_value(field: str, value: str, choices: str) -> None:
    """An unknown string is a ConfigError listing the choices (not a bare enum ValueError)."""
    with pytest.raises(ConfigError) as caught:
        TrainConfig(**{field: value})  # type: ignore[arg-type]
    assert f"unknown {field} {value!r}" in str(caught.value)
    assert choices in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_frozen() -> None:
    """A config is immutable (a point of the search space, hashable)."""
    config = TrainConfig(engine="ddp")  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero_stage = 2  # type: ignore[misc]
    assert len({config, TrainConfig(engine=Engine.DDP)}) == 1


VALID_CONFIGS = [
    TrainConfig(),
    TrainConfig(ac_ops=True, loss=Loss.CHUNKED),
    TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=4, ac_ops=True),
    TrainConfig(engine=Engine.DDP, precision=Precision.FP32, attention=Attention.EAGER),
    TrainConfig(engine=Engine.FSDP, zero_stage=2, precision=Precision.BF16, ac_every=2),
    TrainConfig(engine=Engine.FSDP, zero_stage=3, offload=Offload.PARAMS, ac_every=1),
    TrainConfig(engine=Engine.DEEPSPEED, zero_stage=1, offload=Offload.OPTIMIZER),
    TrainConfig(
        engine=Engine.DEEPSPEED,
        zero_stage=3,
        offload=Offload.PARAMS,
        precision=Precision.FP16_MIXED,
        ac_every=3,
    ),
]


@pytest.mark.parametrize("config", VALID_CONFIGS, ids=lambda c: c.label())
def test_dict_round_trip(config: TrainConfig) -> None:
    """to_dict gives plain JSON values; from_dict(json(to_dict)) gives the same config."""
    data = config.to_dict()
    layout = {"tp", "pp", "pp_schedule", "pp_virtual", "cp"}  # written where not the default
    assert set(data) == {f.name for f in dataclasses.fields(TrainConfig)} - layout
    assert all(type(v) in (str, int, bool) for v in data.values()), data
    assert TrainConfig.from_dict(json.loads(json.dumps(data))) == config


def test_to_dict_values() -> None:
    """Enums are written as their values."""
    config = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, offload=Offload.OPTIMIZER)
    assert config.to_dict() == {
        "engine": "deepspeed",
        "zero_stage": 2,
        "precision": "bf16-mixed",
        "ac_every": 0,
        "ac_ops": False,
        "offload": "optimizer",
        "attention": "sdpa",
        "loss": "full",
        "optimizer": "adamw",
        "lora_rank": 0,
        "torch_compile": False,
        "act_offload": False,
    }


def test_from_dict_rejects_unknown_keys() -> None:
    """Unknown keys are a ConfigError naming them."""
    with pytest.raises(ConfigError, match="unknown configuration keys: bogus, zero"):
        TrainConfig.from_dict({"engine": "ddp", "zero": 1, "bogus": True})


def test_from_dict_partial_and_validated() -> None:
    """Missing keys take their defaults; the result is validated like any config."""
    assert TrainConfig.from_dict({"engine": "ddp"}) == TrainConfig(engine=Engine.DDP)
    with pytest.raises(ConfigError):
        TrainConfig.from_dict({"engine": "ddp", "offload": "params"})


def test_label() -> None:
    """The label names what differs from the defaults."""
    assert TrainConfig().label() == "single ac:off"
    config = TrainConfig(
        engine=Engine.DEEPSPEED,
        zero_stage=3,
        offload=Offload.OPTIMIZER,
        ac_every=2,
        precision=Precision.FP32,
        attention=Attention.EAGER,
    )
    assert config.label() == "deepspeed z3 off:optimizer ac:every-2 fp32 eager"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("off", 0),
        ("none", 0),
        ("0", 0),
        ("no", 0),
        ("false", 0),
        ("OFF", 0),
        ("every", 1),
        ("full", 1),
        ("all", 1),
        ("1", 1),
        (" Every ", 1),
        ("every-1", 1),
        ("every-2", 2),
        ("every2", 2),
        ("2", 2),
        ("every-12", 12),
        ("EVERY-4", 4),
    ],
)
def test_parse_ac(text: str, expected: int) -> None:
    """parse_ac accepts off, every, every-N, N (case and space insensitive)."""
    assert parse_ac(text) == expected


@pytest.mark.parametrize("text", ["", "every-0", "every-", "-1", "sometimes", "1.5", "every--2"])
def test_parse_ac_rejects(text: str) -> None:
    """Anything else is a ConfigError naming the accepted forms."""
    with pytest.raises(ConfigError, match="every-N"):
        parse_ac(text)


@pytest.mark.parametrize("ac_every", [0, 1, 2, 7])
def test_ac_text_round_trip(ac_every: int) -> None:
    """ac_to_text is the inverse of parse_ac."""
    assert parse_ac(ac_to_text(ac_every)) == ac_every
    assert ac_to_text(ac_every) == {0: "off", 1: "every"}.get(ac_every, f"every-{ac_every}")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("ops", (0, True)), ("selective", (0, True)), ("every-2+ops", (2, True)),
     ("off", (0, False)), ("every", (1, False)), ("4+ops", (4, True))],
)  # fmt: skip
def test_parse_ac_ops(text: str, expected: tuple[int, bool]) -> None:
    """``--ac`` takes op-level checkpointing alone or beside every N-th block whole, and the
    label says it back as it is written."""
    assert parse_ac_ops(text) == expected
    every, ops = expected
    assert parse_ac_ops(ac_to_text(every, ops)) == expected
    assert TrainConfig(ac_every=every, ac_ops=ops).label() == f"single ac:{ac_to_text(every, ops)}"


def test_op_level_checkpointing_needs_a_block_left_to_cover() -> None:
    with pytest.raises(ConfigError, match="op-level checkpointing has none left"):
        TrainConfig(ac_every=1, ac_ops=True)
    with pytest.raises(ConfigError, match="every-N"):
        parse_ac_ops("every+ops+ops")
    with pytest.raises(ConfigError, match="use true or false"):
        TrainConfig(ac_ops="maybe")  # type: ignore[arg-type]


def test_losses_are_parsed_from_text_or_lists() -> None:
    assert parse_losses(None) is None
    assert parse_losses("chunked, full,chunked") == (Loss.CHUNKED, Loss.FULL)
    assert parse_losses(["full"]) == (Loss.FULL,)
    with pytest.raises(ConfigError, match="use full or chunked or fused, comma-separated"):
        parse_losses("liger")
    assert parse_losses("fused") == (Loss.FUSED,)
    with pytest.raises(ConfigError, match="use --loss chunked with ZeRO-3"):
        TrainConfig(engine="deepspeed", zero_stage=3, loss="fused")
    assert TrainConfig(loss="chunked").label() == "single ac:off loss:chunked"


def test_an_oom_rules_out_the_larger_sizes_that_accumulate_alike() -> None:
    """A size that accumulates keeps the earlier micro-steps' gradients through the next
    forward; the whole per-rank batch in one micro-step keeps none: an OOM at an accumulating
    size says nothing of it (with FSDP2 it may need 4 bytes a parameter less)."""
    from autotune.space import Workload, micro_batch_options, oom_rules_out

    work = Workload(seq_len=2048, global_batch=64, world_size=8)  # 8 sequences a rank
    assert micro_batch_options(work) == [1, 2, 4, 8]
    accumulation = work.grad_accum
    assert oom_rules_out(2, 4, accumulation) and oom_rules_out(2, 2, accumulation)
    assert not oom_rules_out(4, 2, accumulation)
    assert not oom_rules_out(4, 8, accumulation)  # 8 is trained in one micro-step
    assert oom_rules_out(8, 8, accumulation)
