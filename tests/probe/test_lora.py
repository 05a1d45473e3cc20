"""LoRA (``lora_rank``): real probes on the CPU with peft's adapters on every linear layer of
the blocks, their peaks against what the estimator predicts, in fp32, pure bf16 and bf16
under autocast, with and without checkpointing, on one process and under DDP.

The estimator's LoRA terms were written from the tensors autograd saves in a tiny llama
(hidden 64, 2 blocks, rank 16; docs/estimator.md); the probes here use another shape (hidden
96, intermediate 320, 3 blocks, one key-value head, vocabulary 3,000), rank 8, and the
probe's own live-tensor counter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import RunProbe, probe_failure_text

from autotune.config import ConfigError, Engine, Precision, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome

pytest.importorskip("peft")

SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 3000,
    "hidden_size": 96,
    "intermediate_size": 320,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
RANK = 8


@pytest.fixture(scope="module")
def shape(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-shape") / "config.json"
    path.write_text(json.dumps(SHAPE))
    return path


def test_the_adapters_are_counted_per_linear_layer(shape: Path) -> None:
    """r·(in + out) for each of a block's seven linear layers, and the states they need."""
    spec = resolve_model(str(shape))
    d, i, kv = 96, 320, 32
    assert spec.block_linears == ((d, d), (d, kv), (d, kv), (d, d), (d, i), (d, i), (i, d))
    per_block = RANK * (2 * d + 2 * (d + kv) + 2 * d + 2 * (d + i) + (i + d))
    assert spec.lora_block_params(RANK) == per_block
    lora = TrainConfig(lora_rank=RANK, precision=Precision.BF16)
    full = TrainConfig(precision=Precision.BF16)
    states = estimate_memory(spec, lora, micro_batch_size=1, seq_len=8).breakdown
    assert states["optimizer"] == 8 * 3 * per_block  # fp32 moments of the adapters alone
    assert states["parameters"] == 2 * spec.num_params + 4 * 3 * per_block
    whole = estimate_memory(spec, full, micro_batch_size=1, seq_len=8).breakdown
    assert whole["optimizer"] == 4 * spec.num_params


@pytest.mark.parametrize(
    "bad",
    [
        {"engine": "fsdp", "zero_stage": 3},
        {"engine": "deepspeed", "zero_stage": 2},
        {"ac_ops": True},
        {"loss": "fused"},
        {"loss": "chunked"},
        {"optimizer": "adamw-8bit"},
        {"lora_rank": -4},
    ],
)
def test_what_lora_is_not_modelled_with_is_one_line(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as error:
        TrainConfig(**{"lora_rank": RANK, **bad})
    assert "\n" not in str(error.value) and "use" in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "ranks"),
    [
        # Each dtype regime once (the others in bench/lora_memory.py and docs/estimator.md).
        (TrainConfig(precision=Precision.FP32, lora_rank=RANK), 1),
        (TrainConfig(precision=Precision.BF16, lora_rank=RANK, ac_every=2), 1),
        (TrainConfig(engine=Engine.DDP, precision=Precision.BF16_MIXED, lora_rank=RANK), 2),
    ],
    ids=["fp32", "bf16-ac2", "ddp-bf16-mixed"],
)
def test_probe_peak_is_what_the_estimator_predicts(
    run_probe: RunProbe, shape: Path, config: TrainConfig, ranks: int
) -> None:
    """The probe's live-tensor counter against the estimate at two sizes: each peak within
    2 %, the growth from one size to the next within 3 %, and the loss falls (the adapters
    train)."""
    spec = resolve_model(str(shape))
    result = run_probe(
        config,
        name="lora",
        model=str(shape),
        num_processes=ranks,
        seq_len=256,
        micro_batch_sizes=(1, 4),
    )
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    peaks, predicted = {}, {}
    for size in result.sizes:
        assert all(math.isfinite(x) for x in size.losses) and size.losses[-1] < size.losses[0]
        mbs = size.micro_batch_size
        peaks[mbs] = size.peak_allocated_bytes
        predicted[mbs] = estimate_memory(
            spec, config, micro_batch_size=mbs, seq_len=256, world_size=ranks,
            cuda_allocator=False,
        ).peak_bytes  # fmt: skip
        print(f"{config.label()} mbs {mbs}: measured {peaks[mbs]:,} predicted {predicted[mbs]:,}"
              f" ({peaks[mbs] / predicted[mbs] - 1:+.2%})")  # fmt: skip
    for mbs in peaks:
        assert peaks[mbs] == pytest.approx(predicted[mbs], rel=0.02), mbs
    growth = peaks[4] - peaks[1]
    assert growth == pytest.approx(predicted[4] - predicted[1], rel=0.03)


@pytest.mark.slow
def test_a_qwen_shape_with_biases_is_what_the_estimator_predicts(run_probe: RunProbe) -> None:
    """Qwen2's biased q, k and v projections (peft adapts them like any linear layer) and its
    tied embeddings: the peaks within 2 % at two sizes."""
    spec = resolve_model("tiny-qwen")
    config = TrainConfig(lora_rank=RANK)
    result = run_probe(
        config, name="qwen", model="tiny-qwen", seq_len=256, micro_batch_sizes=(1, 4)
    )
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    for size in result.sizes:
        predicted = estimate_memory(
            spec, config, micro_batch_size=size.micro_batch_size, seq_len=256,
            cuda_allocator=False,
        ).peak_bytes  # fmt: skip
        assert size.peak_allocated_bytes == pytest.approx(predicted, rel=0.02)
