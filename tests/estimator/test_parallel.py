"""Tensor, pipeline and context parallel layouts: their rules (autotune/layouts.py), their
per-rank estimates (autotune/estimator/parallel.py) and the plan that ranks them.

The estimates are checked here against the data-parallel estimator they are built on (at
degree 1 a layout is data parallelism, so the two must agree to the byte and the second) and
against the formulas they cite (in-flight microbatches, TP's division of the states); their
gap to real probes is the CPU probes' (docs/estimator.md), not these tests'.
"""

from __future__ import annotations

import dataclasses

import pytest

from autotune import api
from autotune.config import ConfigError, Engine, Offload, Schedule, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.estimator.parallel import estimate_layout_memory, predict_layout_time
from autotune.estimator.timing import predict_step_time
from autotune.handoff.launch import Launch, render
from autotune.hardware import gpu_spec
from autotune.layouts import check_layout, in_flight, layout_configs, shard_model
from autotune.models import resolve_model
from autotune.probe.spec import ProbeSpec

H100 = gpu_spec("h100-80gb")
FSDP3 = TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=1)


def _layout(**fields: object) -> TrainConfig:
    return dataclasses.replace(FSDP3, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 0}, "--tp 0: use 1 or more"),
        ({"pp_virtual": 2}, "a pipeline schedule needs pipeline stages"),
        ({"pp": 2, "pp_virtual": 2}, "the interleaved schedule runs 2 or more model chunks"),
        ({"pp": 2, "pp_schedule": Schedule.INTERLEAVED_1F1B}, "the interleaved schedule"),
        ({"tp": 2, "engine": Engine.DEEPSPEED, "zero_stage": 1}, "planned with FSDP2 or DDP"),
        ({"tp": 2, "offload": Offload.PARAMS}, "offload is not planned with tensor"),
        ({"cp": 2, "loss": "chunked"}, "the chunked loss is not planned"),
        ({"cp": 2, "attention": "flash_attention_2"}, "--attention sdpa with --cp"),
    ],
)
def test_a_layout_the_configuration_cannot_hold_is_one_line(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        _layout(**fields)
    assert "\n" not in str(caught.value)


def test_a_data_parallel_configuration_reads_and_writes_as_before() -> None:
    plain = TrainConfig(engine=Engine.FSDP, zero_stage=3)
    assert not plain.is_layout
    assert set(plain.to_dict()).isdisjoint({"tp", "pp", "pp_schedule", "pp_virtual", "cp"})
    assert plain.label() == "fsdp z3 ac:off"
    layout = _layout(tp=2, pp=4, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2, cp=2)
    assert layout.label() == "fsdp z3 ac:every tp2 pp4x2:interleaved-1f1b cp2"
    assert TrainConfig.from_dict(layout.to_dict()) == layout
    assert layout.model_parallel == 16


@pytest.mark.parametrize(
    ("config", "world", "seq", "message"),
    [
        (_layout(tp=8, pp=3), 64, 4096, "24 ranks do not divide 64 GPUs"),
        (_layout(tp=16), 64, 4096, "--tp 16 does not fit in a node of 8 GPUs"),
        (_layout(pp=64, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2), 128, 4096,
         "128 stages x virtual stages are more than llama3-70b's 80 layers"),
        (_layout(cp=4), 64, 4100, "4100 tokens does not split into 8 equal chunks"),
        (dataclasses.replace(_layout(cp=2), engine=Engine.SINGLE, zero_stage=0), 2, 4096,
         "1 data-parallel ranks and 2 context ranks share the states"),
    ],
)  # fmt: skip
def test_a_layout_the_world_or_model_cannot_hold_names_the_fix(
    config: TrainConfig, world: int, seq: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_layout(
            config, resolve_model("llama3-70b"), world_size=world, gpus_per_node=8, seq_len=seq
        )


def test_tp_across_nodes_is_taken_when_asked() -> None:
    model = resolve_model("llama3-70b")
    sizes = {"world_size": 64, "gpus_per_node": 4, "seq_len": 4096}
    with pytest.raises(ConfigError, match="--tp 8 does not fit in a node of 4 GPUs"):
        check_layout(_layout(tp=8), model, **sizes)
    check_layout(_layout(tp=8), model, **sizes, tp_across_nodes=True)


def test_in_flight_microbatches_follow_each_schedule() -> None:
    # Korthikanti et al. 2022, section 4.2.3: p under 1F1B (fewer when the step has fewer),
    # p * (1 + (p - 1) / (p v)) interleaved, every microbatch under GPipe.
    assert in_flight(_layout(), 8) == 1.0
    assert in_flight(_layout(pp=4), 8) == 4.0
    assert in_flight(_layout(pp=4), 2) == 2.0
    interleaved = _layout(pp=4, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2)
    assert in_flight(interleaved, 8) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight(_layout(pp=4, pp_schedule=Schedule.GPIPE), 8) == 8.0


def test_a_tp_rank_holds_its_share_of_every_matrix() -> None:
    model = resolve_model("llama3-70b")
    shard = shard_model(model, _layout(tp=8))
    norms = model.num_layers * 2 * model.hidden_size + model.hidden_size
    assert shard.num_params == pytest.approx((model.num_params - norms) / 8 + norms, rel=1e-6)
    stage = shard_model(model, _layout(tp=8, pp=4))
    assert stage.num_layers == 20
    # 80 layers over 3 stages: the most loaded holds 27; interleaved over 3 x 2 chunks, 2 x 14.
    assert shard_model(model, _layout(pp=3)).num_layers == 27
    interleaved = _layout(pp=3, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2)
    assert shard_model(model, interleaved).num_layers == 28
    # A stage holds one vocabulary table: the embedding (first) or the output layer (last).
    assert stage.num_params == pytest.approx(shard.num_params / 4, rel=0.05)


@pytest.mark.parametrize("name", ["llama-7b", "qwen2.5-7b", "tiny"])
@pytest.mark.parametrize(
    ("config", "world"),
    [
        (FSDP3, 8),
        (TrainConfig(ac_ops=True), 1),
        (TrainConfig(engine=Engine.FSDP, zero_stage=2), 16),
    ],
)
def test_at_degree_one_a_layout_is_data_parallelism(
    name: str, config: TrainConfig, world: int
) -> None:
    model = resolve_model(name)
    sizes = {"micro_batch_size": 2, "seq_len": 512, "world_size": world, "grad_accum": 2}
    assert estimate_layout_memory(model, config, **sizes) == estimate_memory(model, config, **sizes)
    layout = predict_layout_time(model, config, H100, **sizes).to_dict()
    plain = predict_step_time(model, config, H100, **sizes).to_dict()
    assert layout == pytest.approx(plain, rel=1e-12)


def test_tp_divides_a_ranks_states_and_activations() -> None:
    model = resolve_model("llama3-70b")
    sizes = {"micro_batch_size": 1, "seq_len": 4096, "world_size": 64, "grad_accum": 1}
    one = estimate_layout_memory(model, _layout(tp=1, pp=2), **sizes)
    eight = estimate_layout_memory(model, _layout(tp=8, pp=2), **sizes)
    # The states are sharded over 32 data-parallel ranks at TP 1 and 4 at TP 8: the same
    # bytes a rank (1/8 of a stage over 4 = a stage over 32). The activations are 1/8 but
    # for the all-gathered inputs of the projections of the block being recomputed.
    assert eight.breakdown["optimizer"] == pytest.approx(one.breakdown["optimizer"], rel=0.02)
    activations = eight.breakdown["activations"]
    assert one.breakdown["activations"] / 8 < activations < one.breakdown["activations"] / 4


def test_the_first_stage_holds_p_microbatches_and_interleaving_more() -> None:
    model = resolve_model("llama3-70b")
    sizes = {"micro_batch_size": 1, "seq_len": 4096, "world_size": 64, "grad_accum": 16}
    one_f_one_b = estimate_layout_memory(model, _layout(tp=8, pp=4, ac_every=0), **sizes)
    interleaved = estimate_layout_memory(
        model,
        _layout(tp=8, pp=4, ac_every=0, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2),
        **sizes,
    )
    gpipe = estimate_layout_memory(
        model, _layout(tp=8, pp=4, ac_every=0, pp_schedule=Schedule.GPIPE), **sizes
    )
    assert (
        one_f_one_b.breakdown["activations"]
        < interleaved.breakdown["activations"]
        < gpipe.breakdown["activations"]
    )


def test_the_pipeline_bubble_shrinks_with_microbatches_and_virtual_stages() -> None:
    model = resolve_model("llama3-70b")

    def speed(config: TrainConfig, accum: int) -> float:
        """Tokens/s of all ranks, the step's microbatches of one sequence each."""
        sizes = {"micro_batch_size": 1, "seq_len": 4096, "world_size": 64, "grad_accum": accum}
        return predict_layout_time(model, config, H100, **sizes).tokens_per_second

    pp = _layout(tp=8, pp=8)
    assert speed(pp, 8) < speed(pp, 64)
    interleaved = _layout(tp=8, pp=8, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2)
    assert speed(pp, 8) < speed(interleaved, 8)


def test_a_405b_model_on_128_h100s_fits_a_layout_without_offload() -> None:
    # Data parallelism alone needs the host (offload) for a 405B model on 128 GPUs; the plan
    # finds TP/PP layouts that train on the GPUs alone.
    dp_only = api.plan("llama3.1-405b", gpu="h100-80gb", gpus=128, tp="1", pp="1", cp="1")
    fitting = [row for row in dp_only.rows if row.fits]
    assert fitting
    assert all(row.config.offload is not Offload.NONE or row.config.act_offload for row in fitting)
    # A node of 8 H100s with 2 TiB of host memory: activation offload would need far more.
    found = api.plan("llama3.1-405b", gpu="h100-80gb", gpus=128, offload=False, host_memory="2TiB")
    first = found.rows[0]
    assert first.fits
    assert first.config.is_layout
    assert first.config.offload is Offload.NONE and not first.config.act_offload


def test_a_plan_takes_a_global_batch_smaller_than_the_gpus_for_its_layouts() -> None:
    found = api.plan(
        "llama3.1-405b", gpu="h100-80gb", gpus=128, global_batch=32, seq_len=8192,
        offload=False, tp="2,4,8", pp="1,2,4,8",
    )  # fmt: skip
    assert found.rows
    assert all(row.config.is_layout for row in found.rows)
    assert all(row.config.model_parallel >= 4 for row in found.rows)  # 32 shares at most
    with pytest.raises(ConfigError, match="global batch 32 is not a multiple of 128 GPUs"):
        api.plan(
            "llama3.1-405b", gpu="h100-80gb", gpus=128, global_batch=32, tp="1", pp="1", cp="1"
        )


def test_degrees_the_user_names_restrict_the_layouts() -> None:
    model = resolve_model("llama3-70b")
    configs = layout_configs(
        model, world_size=64, gpus_per_node=8, seq_len=4096, tp=(8,), pp=(1, 2)
    )
    assert configs
    assert {(c.tp, c.pp) for c in configs} == {(8, 1), (8, 2)}
    assert (
        layout_configs(
            model, world_size=64, gpus_per_node=8, seq_len=4096, tp=(1,), pp=(1,), cp=(1,)
        )
        == []
    )


def test_context_layouts_are_planned_not_probed_and_data_parallel_formats_refuse_a_layout() -> None:
    with pytest.raises(ConfigError, match=r"planned \(autotune plan\), not probed yet"):
        ProbeSpec(model="tiny", config=_layout(cp=2), micro_batch_sizes=(1,), num_processes=2)
    pipeline = dataclasses.replace(_layout(pp=2), engine=Engine.SINGLE, zero_stage=0)
    with pytest.raises(ConfigError, match="needs at least 2 microbatches a step"):
        ProbeSpec(model="tiny", config=pipeline, micro_batch_sizes=(1,), num_processes=2)
    layout = _layout(tp=2)
    with pytest.raises(ConfigError, match="--tp 2 does not divide 3 ranks"):
        ProbeSpec(model="tiny", config=layout, micro_batch_sizes=(1,), num_processes=3)
    exported = Launch(
        model="tiny", config=layout, hidden_size=64, micro_batch_size=1, grad_accum=1,
        world_size=2, seq_len=64,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="--format torchrun writes data parallelism alone"):
        render(exported, "torchrun")
