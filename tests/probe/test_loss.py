"""The chunked loss (``--loss chunked``): the same loss and gradients as the model's own, real
probes under every engine, and the memory it saves against what the estimator predicts.

The estimator's chunked-loss terms were written from the tensors a chunk makes (docs/estimator.md)
and checked against byte-exact traces of a 2-layer llama of vocabulary 32,768 and hidden 128;
the real probes here use other shapes (vocabulary 49,152 and hidden 96; the gpt2 preset), other
sizes and the probe's own memory counter.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import RunProbe, probe_failure_text

from autotune.config import LOSS_CHUNK_TOKENS, Engine, Loss, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import ModelSpec, resolve_model
from autotune.probe import loss as chunked
from autotune.probe.data import synthetic_batch
from autotune.probe.modeling import build_model, materialize
from autotune.probe.outcome import Outcome
from autotune.probe.trace import trace_peak

# A model whose logits dominate: 2 llama blocks of hidden 96 and a 49,152-entry vocabulary.
# No shape the estimator's terms were checked on.
VOCAB_HEAVY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def vocab_heavy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab-heavy") / "config.json"
    path.write_text(json.dumps(VOCAB_HEAVY))
    return path


def _loss_and_grads(
    spec: ModelSpec, loss: Loss, batch: torch.Tensor, labels: torch.Tensor
) -> tuple[float, list[torch.Tensor]]:
    model = build_model(spec, TrainConfig(loss=loss))
    materialize(model, torch.device("cpu"), seed=0)
    torch.manual_seed(1)  # the same dropout masks (gpt2) in both
    value = model(input_ids=batch, labels=labels).loss
    value.backward()
    return value.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("model", ["tiny", "tiny-gpt2", "tiny-qwen"])
@pytest.mark.parametrize("chunk", [37, 64, 10_000])
def test_chunked_loss_equals_the_models_own(
    model: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In fp32, the loss and every gradient agree with the model's own loss, for chunks that
    split the batch unevenly, evenly, or not at all, with ignored labels among them."""
    monkeypatch.setattr(chunked, "LOSS_CHUNK_TOKENS", chunk)
    spec = resolve_model(model)
    batch = synthetic_batch(spec, 2, 64, seed=3)
    labels = batch.clone()
    labels[0, :5] = chunked.IGNORE_INDEX
    full, full_grads = _loss_and_grads(spec, Loss.FULL, batch, labels)
    loss, grads = _loss_and_grads(spec, Loss.CHUNKED, batch, labels)
    assert loss == pytest.approx(full, rel=1e-5)
    for mine, theirs in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


def test_chunk_size_must_be_positive() -> None:
    head = torch.nn.Linear(4, 8)
    with pytest.raises(ValueError, match="at least 1"):
        chunked.chunked_cross_entropy(head, torch.zeros(1, 2, 4), torch.zeros(1, 2).long(), 0)


CHUNKED_ENGINES = [
    pytest.param("tiny", TrainConfig(loss=Loss.CHUNKED), 1, id="single"),
    pytest.param("tiny", TrainConfig(engine=Engine.DDP, loss=Loss.CHUNKED), 2, id="ddp-np2"),
    pytest.param(
        "tiny",
        TrainConfig(engine=Engine.FSDP, zero_stage=3, ac_every=1, loss=Loss.CHUNKED),
        2,
        id="fsdp-z3-ac-np2",
    ),
    pytest.param(
        "tiny-qwen",
        TrainConfig(engine=Engine.DEEPSPEED, zero_stage=3, loss=Loss.CHUNKED),
        2,
        id="qwen-deepspeed-z3-np2",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "config", "num_processes"), CHUNKED_ENGINES)
def test_chunked_loss_trains_under_every_engine(
    run_probe: RunProbe, model: str, config: TrainConfig, num_processes: int
) -> None:
    """A real probe of two chunks a micro-step (4 sequences of 512 tokens) under each engine's
    hooks (DDP's reducer, FSDP2's root, ZeRO-3's gathers of a tied head): it finishes, and the
    loss starts near ln(vocab) and falls."""
    result = run_probe(
        config, model=model, num_processes=num_processes, seq_len=512, micro_batch_sizes=(4,)
    )
    assert result.outcome is Outcome.OK, probe_failure_text(result)
    assert LOSS_CHUNK_TOKENS < 4 * 512  # more than one chunk
    [size] = result.sizes
    losses = size.losses
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert abs(losses[0] - math.log(resolve_model(model).vocab_size)) < 1.0


@pytest.mark.slow
def test_probe_measures_the_saving_the_estimator_predicts(
    run_probe: RunProbe, vocab_heavy: Path
) -> None:
    """The probe's own counter of live tensor bytes, full against chunked, at 1 and 2 chunks
    a micro-step (3 chunks, 6 × 512 tokens, measured once: docs/estimator.md): each chunked
    peak within 1 % of the estimate, the measured saving within 3 % of the predicted one, and
    more than a fifth of the peak once there are two chunks (one chunk saves nothing: it is
    the whole batch's logits, made twice). In fp32: the logits' bytes are what is checked,
    and bf16's matmuls take 41x fp32's on a CPU without AVX-512."""
    spec = resolve_model(str(vocab_heavy))
    sizes = (2, 4)
    measured: dict[Loss, dict[int, int]] = {}
    for loss in (Loss.FULL, Loss.CHUNKED):
        result = run_probe(
            TrainConfig(loss=loss, precision="fp32"),
            name=loss.value,
            model=str(vocab_heavy),
            seq_len=512,
            micro_batch_sizes=sizes,
            timed_steps=1,  # a peak: the second step holds the optimizer states
        )
        assert result.outcome is Outcome.OK, probe_failure_text(result)
        measured[loss] = {s.micro_batch_size: s.peak_allocated_bytes for s in result.sizes}
    for mbs in sizes:
        predicted = {
            loss: estimate_memory(
                spec,
                TrainConfig(loss=loss, precision="fp32"),
                micro_batch_size=mbs,
                seq_len=512,
                cuda_allocator=False,
            ).peak_bytes
            for loss in (Loss.FULL, Loss.CHUNKED)
        }
        saved = measured[Loss.FULL][mbs] - measured[Loss.CHUNKED][mbs]
        print(
            f"mbs {mbs}: full {measured[Loss.FULL][mbs]:,} B (predicted {predicted[Loss.FULL]:,}),"
            f" chunked {measured[Loss.CHUNKED][mbs]:,} B (predicted {predicted[Loss.CHUNKED]:,})"
        )
        assert predicted[Loss.CHUNKED] == pytest.approx(measured[Loss.CHUNKED][mbs], rel=0.01)
        predicted_saving = predicted[Loss.FULL] - predicted[Loss.CHUNKED]
        # Within 3 % of the saving, or 0.2 % of the peak where one chunk saves nothing.
        slack = max(0.03 * abs(saved), 0.002 * measured[Loss.FULL][mbs])
        assert abs(predicted_saving - saved) <= slack
        if mbs * 512 > LOSS_CHUNK_TOKENS:
            assert saved > 0.2 * measured[Loss.FULL][mbs]


@pytest.mark.parametrize("mbs", [2, 3])
def test_gpt2_saving_matches_the_trace(mbs: int) -> None:
    """The gpt2 preset (tied head, vocabulary 50,257) at 2 and 3 chunks: the saving of the
    chunked loss over the model's own, predicted against the byte-exact trace, within 1 %.
    (The peaks themselves carry the estimator's gpt2 block terms: on the CPU, GPT-2's attention
    dropout sends SDPA to its math kernel, which the estimator, modelling the GPUs' kernels,
    does not count; the saving is the loss's alone.)"""
    spec = resolve_model("gpt2")

    def both(peak: Callable[[TrainConfig], int]) -> int:
        return peak(TrainConfig()) - peak(TrainConfig(loss=Loss.CHUNKED))

    traced = both(lambda c: trace_peak(spec, c, micro_batch_size=mbs, seq_len=1024).peak_bytes)
    predicted = both(
        lambda c: (
            estimate_memory(
                spec, c, micro_batch_size=mbs, seq_len=1024, cuda_allocator=False
            ).peak_bytes
        )
    )
    print(f"gpt2 mbs {mbs}: saving traced {traced:,} B, predicted {predicted:,} B")
    assert traced > 0
    assert predicted == pytest.approx(traced, rel=0.01)


# ---- the fused loss (Liger-Kernel, GPUs only): what can be checked without a GPU --------------


def _liger_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Liger-Kernel 0.8.5's chunk, as its source comments state it: inc_factor = ceil(V / H),
    chunk = next_power_of_2(ceil(BT / inc_factor)), at most BT."""
    inc = -(-vocab // hidden)
    per = -(-tokens // inc)
    return min(tokens, 1 << (per - 1).bit_length())


@pytest.mark.parametrize(
    ("model", "mbs", "seq"), [("llama-7b", 4, 4096), ("qwen2.5-1.5b", 4, 2048), ("gpt2", 3, 1024)]
)
def test_fused_loss_memory_follows_ligers_layout(model: str, mbs: int, seq: int) -> None:
    """The fused loss's terms against Liger's own layout, written out here: its chunk (the
    example in its source: 4 x 4096 tokens of a 32,000 vocabulary and hidden 4096 take chunks of
    2048), the weight gradient made in the forward (fp32 masters under autocast, 16-bit
    weights otherwise) counted from the loss on, and a peak below the model's own loss."""
    from autotune.estimator.activations import activation_profile

    assert _liger_chunk(4 * 4096, 32000, 4096) == 2048
    spec = resolve_model(model)
    tokens = mbs * seq
    for knobs, weight_bytes in (({}, 4), ({"engine": "fsdp", "zero_stage": 3}, 2)):
        config = TrainConfig(loss=Loss.FUSED, **knobs)
        profile = activation_profile(spec, config, seq)
        chunk = _liger_chunk(tokens, spec.vocab_size, spec.hidden_size)
        assert profile.loss_chunk(tokens) == chunk
        assert profile.head_loss_bytes == weight_bytes * spec.vocab_size * spec.hidden_size
        world = 8 if knobs else 1
        fused, full = (
            estimate_memory(
                spec,
                TrainConfig(loss=loss, **knobs),
                micro_batch_size=mbs,
                seq_len=seq,
                world_size=world,
                cuda_allocator=False,
            )
            for loss in (Loss.FUSED, Loss.FULL)
        )
        assert fused.peak_bytes < full.peak_bytes
        loss_point = fused.breakdown["gradients"] if fused.phase == "loss" else None
        assert loss_point is None or loss_point >= profile.head_loss_bytes


def test_a_plan_with_the_fused_loss_keeps_it_and_a_simulated_run_measures_it(
    tmp_path: Path,
) -> None:
    """``plan --loss full,fused`` for a GPU elsewhere: fused rows beside the model's own, kept
    even where the model's own fits as large a micro-batch (it is predicted faster, not only
    lighter); a simulated run with it ends with a fused configuration measured."""
    from autotune import api

    planned = api.plan("qwen2.5-1.5b", gpu="h100-80gb", gpus=1, losses="full,fused")
    losses = {row.config.loss for row in planned.rows}
    assert losses == {Loss.FULL, Loss.FUSED}
    configs = {row.config for row in planned.rows}
    for config in configs:
        zero3 = config.engine is Engine.DEEPSPEED and config.zero_stage == 3  # not with fused
        # An offloaded row's fused twin is dropped where the fused loss alone fits as much.
        if config.loss is Loss.FULL and not (config.ac_ops or zero3 or config.act_offload):
            assert dataclasses.replace(config, loss=Loss.FUSED) in configs, config.label()
    default = api.plan("qwen2.5-1.5b", gpu="h100-80gb", gpus=1)
    assert Loss.FUSED not in {row.config.loss for row in default.rows}  # only when asked
    summary = api.tune(
        "qwen2.5-1.5b",
        simulate="h100-80gb",
        gpus=1,
        budget="1h",
        losses="fused",
        storage=f"sqlite:///{tmp_path}/t.db",
        trials_dir=tmp_path / "trials",
    )
    assert summary.best is not None and summary.best.config.loss is Loss.FUSED
