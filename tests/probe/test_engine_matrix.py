"""Every supported configuration trains for real on the CPU, in one and two processes.

The matrix is generated from TrainConfig's own validation: engines x zero stages x offload x
activation checkpointing (off, every block, every 2nd block), keeping what TrainConfig accepts.
Each probe runs the tiny model at micro-batch 2 and must finish ok with every size field, finite
losses and a falling loss. A few precision, attention and model variants run beside it.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
from conftest import SIZE_FIELDS, RunProbe, exit_summary, probe_failure_text, read_json

from autotune.config import (
    Attention,
    ConfigError,
    Engine,
    Offload,
    Precision,
    TrainConfig,
)
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome
from autotune.probe.result import ProbeResult

pytestmark = pytest.mark.slow


def _supported_configs() -> list[TrainConfig]:
    configs = []
    for engine, stage, offload, ac in itertools.product(Engine, range(4), Offload, (0, 1, 2)):
        try:
            config = TrainConfig(engine=engine, zero_stage=stage, offload=offload, ac_every=ac)
        except ConfigError:
            continue
        configs.append(config)
    return configs


def _matrix() -> list[Any]:
    cases = []
    for config in _supported_configs():
        for np in (1,) if config.engine is Engine.SINGLE else (1, 2):
            name = (
                f"{config.engine.value}-z{config.zero_stage}-{config.offload.value}"
                f"-ac{config.ac_every}-np{np}"
            )
            cases.append(pytest.param(config, np, id=name))
    return cases


MATRIX = _matrix()


def test_matrix_covers_every_engine_and_option() -> None:
    """The generated matrix is not accidentally thin: each engine, stage and offload appears."""
    configs = [p.values[0] for p in MATRIX]
    assert {c.engine for c in configs} == set(Engine)
    assert {(c.engine, c.zero_stage) for c in configs if c.engine is Engine.DEEPSPEED} == {
        (Engine.DEEPSPEED, s) for s in range(4)
    }
    assert {c.offload for c in configs if c.engine is Engine.DEEPSPEED} == set(Offload)
    assert {c.offload for c in configs if c.engine is Engine.FSDP} == {Offload.NONE, Offload.PARAMS}
    assert {c.ac_every for c in configs} == {0, 1, 2}
    assert len(MATRIX) == 81  # 3 single + 6 ddp + 24 fsdp + 48 deepspeed


def _assert_trains(result: ProbeResult, num_processes: int) -> None:
    """The probe finished ok, reported every field, and the loss is finite and falling from
    where a freshly initialized model starts (near ln(vocab): near-uniform predictions)."""
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    assert exit_summary(result.exits) == [
        {"rank": r, "returncode": 0, "killed_by_launcher": False, "finished": True}
        for r in range(num_processes)
    ]
    for rank in range(num_processes):
        assert read_json(result.probe_dir / f"rank{rank}.json")["status"] == "ok"
    [size] = result.sizes
    missing = [f for f in SIZE_FIELDS if f not in size.to_dict()]
    assert not missing, f"size fields missing: {missing}"
    assert size.micro_batch_size == 2
    assert size.outcome == "ok"
    assert size.mfu is None and size.hfu is None
    assert size.tokens_per_second > 0
    assert size.tokens_per_second == pytest.approx(size.tokens_per_second_per_rank * num_processes)
    assert size.peak_allocated_bytes > 0
    losses = size.losses
    assert len(losses) == 3
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    uniform = math.log(resolve_model(result.spec.model).vocab_size)
    assert abs(losses[0] - uniform) < 1.0, f"first loss {losses[0]:.2f}, ln(vocab) {uniform:.2f}"


@pytest.mark.parametrize(("config", "num_processes"), MATRIX)
def test_supported_config_trains(
    run_probe: RunProbe, config: TrainConfig, num_processes: int
) -> None:
    """This configuration trains on the CPU in this many processes, accumulating 2 micro-steps
    an optimizer step as the search's probes do (DeepSpeed's boundary set by the step loop)."""
    result = run_probe(config, num_processes=num_processes, grad_accum=2)
    _assert_trains(result, num_processes)


VARIANTS = [
    pytest.param("tiny", TrainConfig(precision=Precision.FP16_MIXED), 1, id="single-fp16-mixed"),
    pytest.param("tiny", TrainConfig(precision=Precision.BF16), 1, id="single-bf16"),
    pytest.param("tiny", TrainConfig(precision=Precision.FP32), 1, id="single-fp32"),
    pytest.param(
        "tiny", TrainConfig(engine=Engine.DDP, attention=Attention.EAGER), 1, id="ddp-eager"
    ),
    pytest.param(
        "tiny",
        TrainConfig(engine=Engine.FSDP, zero_stage=3, precision=Precision.BF16),
        1,
        id="fsdp-z3-bf16",
    ),
    pytest.param(
        "tiny",
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=2, precision=Precision.FP32),
        1,
        id="deepspeed-z2-fp32",
    ),
    *(
        pytest.param(
            model,
            TrainConfig(engine=engine, zero_stage=3),
            np,
            id=f"{model}-{engine.value}-z3-np{np}",
        )
        for model in ("tiny-gpt2", "tiny-qwen")
        for engine in (Engine.FSDP, Engine.DEEPSPEED)
        for np in (1, 2)
    ),
]


@pytest.mark.parametrize(("model", "config", "num_processes"), VARIANTS)
def test_variant_trains(
    run_probe: RunProbe, model: str, config: TrainConfig, num_processes: int
) -> None:
    """Other precisions, eager attention, GPT-2 and Qwen2 (tied head, qkv bias) train too."""
    result = run_probe(config, model=model, num_processes=num_processes)
    _assert_trains(result, num_processes)


def test_deepspeed_zero3_builds_in_a_fresh_interpreter(run_probe: RunProbe) -> None:
    """A rank started fresh (``autotune probe``, ``--no-warm``), not forked from the warm
    process that imported everything: ZeRO-3's zero.Init must not be the first to import
    torch._dynamo (its polyfill of Tensor.__new__ then meets zero.Init's and raises)."""
    config = TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3)
    result = run_probe(config, num_processes=2, spawner="subprocess")
    assert result.outcome is Outcome.OK, probe_failure_text(result)
