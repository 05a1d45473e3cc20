"""8-bit AdamW (``--optimizer adamw-8bit``): real probes on the CPU under the plain engine and
FSDP2, the moments' bytes they save against what the estimator predicts, and the time model's
charge for its step.

The estimator's rule for the 8-bit moments (1-byte codes, an fp32 scale per 256 values, a
256-entry fp32 code map, plain moments for tensors under 4,096 values or not a whole number of
blocks) is read from torchao's source, not fitted; the model here has tensors of each kind (a
key projection of 3,072 values, MLP weights of 28,800, not a multiple of 256, norms of 96).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import RunProbe, probe_failure_text

from autotune.config import Engine, Optimizer, TrainConfig
from autotune.estimator.memory import estimate_memory, moment_bytes
from autotune.estimator.timing import predict_step_time
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.probe.outcome import Outcome

pytest.importorskip("torchao")

MIXED = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4000,
    "hidden_size": 96,
    "intermediate_size": 300,
    "num_hidden_layers": 3,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mixed-tensors") / "config.json"
    path.write_text(json.dumps(MIXED))
    return path


def test_the_rule_quantizes_only_whole_blocks_of_large_tensors(mixed: Path) -> None:
    """Per tensor: 2 bytes a value plus the scales and code maps when quantized, 8 (two fp32
    moments) when not; pure bf16 keeps the small ones' moments in bf16."""
    spec = resolve_model(str(mixed))
    eight = TrainConfig(optimizer=Optimizer.ADAMW_8BIT)
    sizes = dict(spec.parameter_tensors)
    assert sizes[96 * 32] == 2 * 3 and sizes[96 * 300] == 3 * 3 and sizes[96] == 2 * 3 + 1
    quantized = sum(
        count * 2 * (n + n / 64 + 1024) for n, count in sizes.items() if n >= 4096 and n % 256 == 0
    )
    plain = sum(count * 8 * n for n, count in sizes.items() if n < 4096 or n % 256)
    assert moment_bytes(spec, eight) == pytest.approx(quantized + plain)
    assert moment_bytes(spec, TrainConfig()) == 8 * spec.num_params
    bf16 = TrainConfig(optimizer=Optimizer.ADAMW_8BIT, precision="bf16")
    assert moment_bytes(spec, bf16) == pytest.approx(quantized + plain / 2)
    # Sharded over 2 ranks, each shard is judged on its own: 96 x 300 / 2 = 14,400 values.
    assert moment_bytes(spec, eight, 2) < moment_bytes(spec, TrainConfig(), 2) / 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "ranks"),
    [
        # fp32: the optimizer's states are what is checked, not the precision (bf16 matmuls
        # take 41x the fp32 ones on a CPU without AVX-512).
        (TrainConfig(precision="fp32"), 1),
        (TrainConfig(engine=Engine.FSDP, zero_stage=3, precision="fp32"), 2),
    ],
    ids=["single", "fsdp-z3-np2"],
)
def test_probe_measures_the_saving_the_estimator_predicts(
    run_probe: RunProbe, mixed: Path, config: TrainConfig, ranks: int
) -> None:
    """The probe's live-tensor counter, fused AdamW against 8-bit AdamW at the same size: the
    measured saving within 1 % of the predicted one, each peak within 2 % of its estimate,
    and the loss falls (the 8-bit step trains)."""
    spec = resolve_model(str(mixed))
    peaks, predicted = {}, {}
    for optimizer in Optimizer:
        chosen = TrainConfig(**{**config.to_dict(), "optimizer": optimizer})
        result = run_probe(
            chosen,
            name=optimizer.value,
            model=str(mixed),
            num_processes=ranks,
            seq_len=256,
            micro_batch_sizes=(2,),
        )
        assert result.outcome is Outcome.OK, probe_failure_text(result)
        [size] = result.sizes
        assert all(math.isfinite(x) for x in size.losses) and size.losses[-1] < size.losses[0]
        peaks[optimizer] = size.peak_allocated_bytes
        predicted[optimizer] = estimate_memory(
            spec, chosen, micro_batch_size=2, seq_len=256, world_size=ranks
        ).peak_bytes
        assert peaks[optimizer] == pytest.approx(predicted[optimizer], rel=0.02)
    saved = peaks[Optimizer.ADAMW] - peaks[Optimizer.ADAMW_8BIT]
    expected = predicted[Optimizer.ADAMW] - predicted[Optimizer.ADAMW_8BIT]
    assert expected > 0.02 * peaks[Optimizer.ADAMW]  # a saving the counter can see
    assert saved == pytest.approx(expected, rel=0.01)


def test_the_8bit_step_is_charged_its_calls_and_never_faster() -> None:
    """The time model: the 8-bit step is fused AdamW's streaming or one compiled call a
    tensor, whichever is longer; the micro-steps are unchanged."""
    gpu = gpu_spec("h100-80gb")
    for name in ("llama-7b", "qwen2.5-1.5b"):
        spec = resolve_model(name)
        tensors = sum(count for _, count in spec.parameter_tensors)
        times = {
            o: predict_step_time(
                spec, TrainConfig(optimizer=o), gpu, micro_batch_size=1, seq_len=2048
            )
            for o in Optimizer
        }
        fused, eight = times[Optimizer.ADAMW], times[Optimizer.ADAMW_8BIT]
        assert eight.micro_step_s == fused.micro_step_s
        assert eight.optimizer_step_s == pytest.approx(
            max(fused.optimizer_step_s, tensors * 250e-6)
        )
        assert eight.optimizer_step_s >= fused.optimizer_step_s
