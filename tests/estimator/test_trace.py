"""Tests for autotune.probe.trace: one training step traced under fake tensors."""

from __future__ import annotations

import gc
import json

import benchmarks
import pytest
import torch
import torch.distributed as dist
from transformers import masking_utils

from autotune.config import Attention, Engine, Precision, TrainConfig
from autotune.models import ModelSpec, resolve_model
from autotune.probe import modeling
from autotune.probe.data import synthetic_batch
from autotune.probe.engines import EngineContext, build_trainee
from autotune.probe.engines import ddp as ddp_engine
from autotune.probe.memory import LiveTensorBytes
from autotune.probe.trace import CATEGORIES, TracedPeak, trace_peak

# The model of bench/model_states.py, whose bytes per parameter docs/estimator.md records: four
# llama blocks of hidden 256, so at sequence length 4 the activations are negligible.
STATES_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "use_cache": False,
}


@pytest.fixture(scope="module")
def states_model(tmp_path_factory: pytest.TempPathFactory) -> ModelSpec:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(STATES_MODEL))
    return resolve_model(str(path))


def measure_real_step(
    spec: ModelSpec, config: TrainConfig, *, micro_batch_size: int, seq_len: int, grad_accum: int
) -> tuple[int, int]:
    """State and peak bytes of a real second step, counted by the probe's CPU counter."""

    def step() -> None:
        loss = None
        for micro in range(grad_accum):
            sync = micro == grad_accum - 1
            loss = trainee.forward(batch, sync=sync)
            trainee.backward(loss, sync=sync)
        trainee.optimizer_step()
        del loss

    with LiveTensorBytes() as counter:
        trainee = build_trainee(
            EngineContext(
                model=spec,
                config=config,
                device=torch.device("cpu"),
                rank=0,
                world_size=1,
                micro_batch_size=micro_batch_size,
                grad_accum=grad_accum,
                lr=1e-4,
                seed=0,
            )
        )
        batch = synthetic_batch(spec, micro_batch_size, seq_len)
        step()
        gc.collect()
        counter.reset_peak()
        state = counter.live_bytes
        step()
    return state, counter.peak_bytes


@pytest.mark.parametrize(
    ("model", "knobs", "grad_accum"),
    [
        ("tiny", {}, 1),
        ("tiny", {"ac_every": 1}, 1),
        ("tiny", {"attention": "eager"}, 2),
        ("tiny", {"precision": "fp16-mixed"}, 1),
        ("tiny-qwen", {"precision": "bf16", "ac_every": 1}, 1),
        ("tiny-gpt2", {"precision": "fp32"}, 1),
    ],
)
def test_traced_step_equals_a_real_step(model: str, knobs: dict, grad_accum: int) -> None:
    """A real CPU step, counted byte by byte, peaks where the fake trace says."""
    spec = resolve_model(model)
    config = TrainConfig(**knobs)
    state, peak = measure_real_step(
        spec, config, micro_batch_size=2, seq_len=64, grad_accum=grad_accum
    )
    traced = trace_peak(spec, config, micro_batch_size=2, seq_len=64, grad_accum=grad_accum)
    assert traced.peak_bytes == pytest.approx(peak, rel=1e-3)
    assert traced.state_bytes == pytest.approx(state, rel=1e-3)


def test_model_states_match_the_measured_bytes_per_parameter(states_model: ModelSpec) -> None:
    """docs/estimator.md: fused AdamW with fp32 master weights holds 16 P at the step's peak,
    12 P between steps (gradients freed); pure bf16 half of that."""
    params = states_model.num_params
    mixed = trace_peak(states_model, TrainConfig(), micro_batch_size=1, seq_len=4)
    assert mixed.peak_bytes / params == pytest.approx(16.0, abs=0.02)
    assert mixed.state_bytes / params == pytest.approx(12.0, abs=0.01)
    assert mixed.by_category["parameters"] == 4 * params
    assert mixed.by_category["optimizer"] / params == pytest.approx(8.0, abs=0.001)
    pure = trace_peak(
        states_model, TrainConfig(precision=Precision.BF16), micro_batch_size=1, seq_len=4
    )
    assert pure.peak_bytes / params == pytest.approx(8.0, abs=0.01)
    assert pure.state_bytes / params == pytest.approx(6.0, abs=0.01)
    assert pure.by_category["parameters"] == 2 * params


def test_breakdown_sums_to_the_peak_and_round_trips_as_json() -> None:
    traced = trace_peak("tiny", TrainConfig(), micro_batch_size=2, seq_len=64)
    assert isinstance(traced, TracedPeak)
    assert tuple(traced.by_category) == CATEGORIES
    assert sum(traced.by_category.values()) == traced.peak_bytes
    assert sum(traced.detail.values()) == traced.peak_bytes
    assert traced.peak_bytes > traced.state_bytes > 0
    assert traced.traced_layers == (2,)
    data = json.loads(json.dumps(traced.to_dict()))
    assert data["config"] == TrainConfig().to_dict()
    assert data["peak_bytes"] == traced.peak_bytes
    assert data["traced_layers"] == [2]


def test_activations_grow_linearly_with_the_micro_batch() -> None:
    peaks = [
        trace_peak("tiny", TrainConfig(), micro_batch_size=mbs, seq_len=256).peak_bytes
        for mbs in (1, 2, 4)
    ]
    per_sequence = peaks[1] - peaks[0]
    assert per_sequence > 0
    assert peaks[2] - peaks[1] == pytest.approx(2 * per_sequence, rel=0.01)


def test_checkpointing_every_block_lowers_the_activation_peak() -> None:
    off = trace_peak("tiny", TrainConfig(), micro_batch_size=4, seq_len=256)
    every = trace_peak("tiny", TrainConfig(ac_every=1), micro_batch_size=4, seq_len=256)
    assert every.peak_bytes < off.peak_bytes
    assert every.by_category["activations"] < off.by_category["activations"]
    assert every.state_bytes == off.state_bytes


def test_eager_attention_materializes_the_score_matrix() -> None:
    """At a long sequence eager attention's seq x seq scores outweigh everything SDPA keeps."""
    sdpa = trace_peak("tiny", TrainConfig(), micro_batch_size=1, seq_len=512)
    eager = trace_peak(
        "tiny", TrainConfig(attention=Attention.EAGER), micro_batch_size=1, seq_len=512
    )
    scores = 4 * 512 * 512 * 4  # one block's fp32 softmax over 4 heads
    assert eager.peak_bytes - sdpa.peak_bytes > scores


def test_sdpa_runs_without_a_materialized_mask() -> None:
    """With the trace's transformers patch, sdpa gets is_causal and no mask, as in a real step:
    the traced peak does not grow by a seq x seq boolean mask at a long sequence."""
    short = trace_peak("tiny", TrainConfig(), micro_batch_size=1, seq_len=256)
    long = trace_peak("tiny", TrainConfig(), micro_batch_size=1, seq_len=512)
    # Without a mask the peak grows about linearly with the sequence (this difference is
    # negative); a boolean mask would add 512 * 512 bytes at 512 against 2 * 256 * 256 at 256.
    assert long.peak_bytes - 2 * short.peak_bytes + short.state_bytes < 512 * 512 // 4


def test_patches_are_undone_after_a_trace() -> None:
    original_find = masking_utils.find_packed_sequence_indices
    trace_peak("tiny", TrainConfig(precision=Precision.BF16), micro_batch_size=1, seq_len=8)
    assert masking_utils.find_packed_sequence_indices is original_find
    assert ddp_engine.build_model is modeling.build_model
    assert ddp_engine.materialize is modeling.materialize
    assert not dist.is_initialized()


@pytest.mark.parametrize("ac_every", [0, 1, 2])
def test_extrapolation_equals_a_full_depth_trace(ac_every: int) -> None:
    """Two shallow copies extrapolate exactly (peak, breakdown and state) to the full depth."""
    spec = resolve_model("tiny").with_layers(10)
    config = TrainConfig(ac_every=ac_every)
    extrapolated = trace_peak(spec, config, micro_batch_size=2, seq_len=128)
    full = trace_peak(spec, config, micro_batch_size=2, seq_len=128, layers=10)
    assert len(extrapolated.traced_layers) == 2
    assert max(extrapolated.traced_layers) < 10
    assert full.traced_layers == (10,)
    assert extrapolated.peak_bytes == pytest.approx(full.peak_bytes, rel=0.01)
    for category in CATEGORIES:
        assert extrapolated.by_category[category] == pytest.approx(
            full.by_category[category], rel=0.01, abs=1024
        )
    assert extrapolated.state_bytes == full.state_bytes
    assert extrapolated.num_layers == 10


def test_layers_traces_exactly_that_depth() -> None:
    one = trace_peak("llama-7b", TrainConfig(), micro_batch_size=1, seq_len=128, layers=1)
    two = trace_peak("llama-7b", TrainConfig(), micro_batch_size=1, seq_len=128, layers=2)
    assert one.traced_layers == (1,) and two.traced_layers == (2,)
    assert one.num_layers == 1
    block = resolve_model("llama-7b").num_block_params // 32
    # One more block adds its weights and Adam moments (12 bytes per parameter) to the state,
    # and a 4-byte AdamW step counter for each of its 9 weight tensors.
    assert two.state_bytes - one.state_bytes == 12 * block + 9 * 4
    assert two.peak_bytes > one.peak_bytes


def test_fsdp_shards_the_state_over_a_fake_process_group(states_model: ModelSpec) -> None:
    params = states_model.num_params
    config = TrainConfig(engine=Engine.FSDP, zero_stage=3)
    one = trace_peak(states_model, config, micro_batch_size=1, seq_len=4, world_size=1)
    two = trace_peak(states_model, config, micro_batch_size=1, seq_len=4, world_size=2)
    assert one.state_bytes / params == pytest.approx(12.0, abs=0.01)
    assert two.state_bytes / params == pytest.approx(6.0, abs=0.01)
    assert two.peak_bytes < one.peak_bytes
    assert two.detail.get("Unsharded Param", 0) > 0  # blocks are gathered while they run
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("knobs", "world_size", "message"),
    [
        ({"engine": "deepspeed", "zero_stage": 2}, 1, "deepspeed cannot be traced"),
        ({"engine": "ddp"}, 1, "ddp cannot be traced"),
        ({"engine": "fsdp", "zero_stage": 3, "offload": "params"}, 2, "offload"),
        ({}, 2, "engine single runs one process"),
        ({"lora_rank": 8}, 1, "LoRA cannot be traced"),
        ({"act_offload": True}, 1, "activation offload cannot be traced"),
        ({"torch_compile": True}, 1, "compiled blocks cannot be traced"),
    ],
)
def test_untraceable_configurations_are_rejected(
    knobs: dict, world_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        trace_peak(
            "tiny", TrainConfig(**knobs), micro_batch_size=1, seq_len=8, world_size=world_size
        )


def test_sizes_are_validated() -> None:
    with pytest.raises(ValueError, match="micro_batch_size"):
        trace_peak("tiny", TrainConfig(), micro_batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match="positions"):
        trace_peak("tiny", TrainConfig(), micro_batch_size=1, seq_len=100_000)
    with pytest.raises(ValueError, match="layers"):
        trace_peak("tiny", TrainConfig(), micro_batch_size=1, seq_len=8, layers=0)


@pytest.mark.slow
def test_extrapolation_to_a_real_preset_is_exact() -> None:
    """qwen2.5-1.5b's 28 blocks: the extrapolation equals the full-depth trace (about 1 min)."""
    config = TrainConfig(ac_every=1)
    extrapolated = trace_peak("qwen2.5-1.5b", config, micro_batch_size=1, seq_len=2048)
    full = trace_peak("qwen2.5-1.5b", config, micro_batch_size=1, seq_len=2048, layers=28)
    assert extrapolated.peak_bytes == pytest.approx(full.peak_bytes, rel=1e-3)
    assert extrapolated.state_bytes == full.state_bytes


def test_states_model_fixture_is_the_bench_model() -> None:
    """Keep the copy above in step with bench/model_states.py."""
    assert benchmarks.load("model_states").MODEL_CONFIG == STATES_MODEL
