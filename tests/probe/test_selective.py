"""Op-level selective checkpointing (``--ac ops``): the same gradients as no checkpointing,
real probes under every engine, and the memory it saves against what the estimator predicts.

The estimator's term (a block keeps its input and the outputs of ``SELECTIVE_SAVED_OPS``) was
written from the tensors those ops make and checked against traces of an 8-block llama of
hidden 512; the checks here use the real llama-7b and qwen2.5-1.5b shapes (traced) and a
2-block llama of hidden 128, 2 heads and one key-value head (the probe's own counter of live
tensor bytes).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import RunProbe, probe_failure_text
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from autotune.config import Engine, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.estimator.timing import predict_step_time
from autotune.hardware import gpu_spec
from autotune.models import resolve_model
from autotune.probe.data import synthetic_batch
from autotune.probe.modeling import build_model, decoder_blocks, materialize
from autotune.probe.outcome import Outcome
from autotune.probe.trace import trace_peak

BLOCKY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
"""Narrow, so that the blocks' activations, which the term is about, make most of the peak (two
thirds or more at 4 sequences, by the estimate), and the bf16 matmuls of a CPU without AVX-512
stay short."""
BLOCKY_SEQ = 256


@pytest.fixture(scope="module")
def blocky(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocky") / "config.json"
    path.write_text(json.dumps(BLOCKY))
    return path


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2", "tiny-qwen"])
def test_selective_checkpointing_gives_the_same_gradients(model: str) -> None:
    """Every block wrapped, and the loss and every gradient of a step as without checkpointing
    (fp32; GPT-2's dropout masks replayed by the checkpoint's RNG state)."""
    spec = resolve_model(model)
    batch = synthetic_batch(spec, 2, 64, seed=5)
    results = []
    for config in (TrainConfig(precision="fp32"), TrainConfig(precision="fp32", ac_ops=True)):
        module = build_model(spec, config)
        materialize(module, torch.device("cpu"), seed=0)
        wrapped = [isinstance(b, CheckpointWrapper) for b in decoder_blocks(module)]
        assert all(wrapped) is config.ac_ops
        torch.manual_seed(1)
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in module.parameters()]))
    (plain, plain_grads), (selective, grads) = results
    assert selective == pytest.approx(plain, rel=1e-6)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("model", ["llama-7b", "qwen2.5-1.5b"])
@pytest.mark.parametrize(
    ("knobs", "world"),
    [({}, 1), ({"engine": "fsdp", "zero_stage": 3}, 8), ({"ac_every": 4}, 1)],
)
@pytest.mark.parametrize("mbs", [1, 4])
def test_the_real_shapes_match_the_trace(model: str, knobs: dict, world: int, mbs: int) -> None:
    """llama-7b and qwen2.5-1.5b at 2048 tokens a sequence, every block selective (or every
    4th whole and the rest selective), one rank or one of 8 FSDP2 ranks: the predicted peak
    within 1.5 % of the byte-exact trace."""
    spec = resolve_model(model)
    config = TrainConfig(ac_ops=True, **knobs)
    traced = trace_peak(spec, config, micro_batch_size=mbs, seq_len=2048, world_size=world)
    predicted = estimate_memory(
        spec, config, micro_batch_size=mbs, seq_len=2048, world_size=world, cuda_allocator=False
    )
    assert predicted.peak_bytes == pytest.approx(traced.peak_bytes, rel=0.015)


CHECKPOINTED_ENGINES = [
    pytest.param(TrainConfig(ac_ops=True), 1, id="single"),
    pytest.param(TrainConfig(engine=Engine.DDP, ac_ops=True, ac_every=2), 2, id="ddp-every-2+ops"),
    pytest.param(TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_ops=True), 2, id="fsdp-z3"),
    pytest.param(TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, ac_ops=True), 2, id="ds-z3"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("config", "num_processes"), CHECKPOINTED_ENGINES)
def test_selective_checkpointing_trains_under_every_engine(
    run_probe: RunProbe, config: TrainConfig, num_processes: int
) -> None:
    """A real probe under each engine's hooks (DDP's reducer, FSDP2's per-block gathers,
    ZeRO-3's fetches in the recomputation): it finishes and the loss falls."""
    result = run_probe(config, num_processes=num_processes)
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    [size] = result.sizes
    assert all(math.isfinite(x) for x in size.losses) and size.losses[-1] < size.losses[0]


@pytest.mark.slow
def test_probe_measures_the_saving_the_estimator_predicts(
    run_probe: RunProbe, blocky: Path
) -> None:
    """The probe's counter of live tensor bytes with and without op-level checkpointing, in
    bf16-mixed, at 2 and 4 sequences of 256 tokens (8 measured once: peaks within 0.4 %, the
    saving 16,545,792 B against 16,548,864 predicted): each peak within 2 % of its estimate,
    and the measured saving within 10 % of the predicted one. (In fp32 the estimate of the
    checkpointed peak is 4-6 % under the measurement on this shape: bf16-mixed is the regime
    checked.)"""
    spec = resolve_model(str(blocky))
    sizes = (2, 4)
    measured = {}
    for ops in (False, True):
        result = run_probe(
            TrainConfig(ac_ops=ops),
            name=f"ops-{ops}",
            model=str(blocky),
            seq_len=BLOCKY_SEQ,
            micro_batch_sizes=sizes,
            timed_steps=1,  # a peak: the second step holds the optimizer states
        )
        assert result.outcome is Outcome.OK, probe_failure_text(result)
        measured[ops] = {s.micro_batch_size: s.peak_allocated_bytes for s in result.sizes}
    for mbs in sizes:
        predicted = {
            ops: estimate_memory(
                spec,
                TrainConfig(ac_ops=ops),
                micro_batch_size=mbs,
                seq_len=BLOCKY_SEQ,
                cuda_allocator=False,
            ).peak_bytes
            for ops in (False, True)
        }
        saved = measured[False][mbs] - measured[True][mbs]
        print(
            f"mbs {mbs}: off {measured[False][mbs]:,} B (predicted {predicted[False]:,}), "
            f"ops {measured[True][mbs]:,} B (predicted {predicted[True]:,})"
        )
        assert predicted[True] == pytest.approx(measured[True][mbs], rel=0.02)
        assert saved > 0
        assert predicted[False] - predicted[True] == pytest.approx(saved, rel=0.10)


def test_the_time_model_charges_the_cheap_ops_again() -> None:
    """On an H100, op-level checkpointing costs more than nothing and less than checkpointing
    every block whole (no matmul or attention runs again), and counts no hardware FLOPs."""
    spec, gpu = resolve_model("llama-7b"), gpu_spec("h100-80gb")

    def step(**knobs: object) -> tuple[float, float | None]:
        config = TrainConfig(engine="fsdp", zero_stage=3, **knobs)  # type: ignore[arg-type]
        time = predict_step_time(
            spec, config, gpu, micro_batch_size=2, seq_len=4096, grad_accum=1, world_size=8
        )
        return time.step_s, time.hfu and time.hfu / (time.mfu or 1.0)

    off, ops, every = step(), step(ac_ops=True), step(ac_every=1)
    assert off[0] < ops[0] < every[0]
    assert ops[1] == pytest.approx(off[1])  # hardware over model FLOPs: unchanged
