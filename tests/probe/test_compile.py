"""Compiled decoder blocks (``--compile``): the same loss and gradients as eager, real probes
whose compiled graphs run under the CPU's live-tensor counter, and the memory compiling saves
against what the estimator predicts.

The estimator's compiled saved set was listed from the graphs AOT autograd partitions for a
4-block llama of hidden 384 (every dtype regime); the checks here use a 2-block llama of hidden
256, intermediate 768, 4 heads and one key-value head (vocabulary 1,000), which it was not
written on (two blocks: each is compiled on its own, once a micro-batch shape, and the compiles
take most of a probe's time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import RunProbe, probe_failure_text

from autotune.config import ConfigError, TrainConfig
from autotune.estimator.memory import estimate_memory
from autotune.models import resolve_model
from autotune.probe.compile import CompiledBlock
from autotune.probe.data import synthetic_batch
from autotune.probe.modeling import build_model, decoder_blocks, materialize
from autotune.probe.outcome import Outcome

COMPACT = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
SEQ = 256


@pytest.fixture(scope="module")
def compact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compact") / "config.json"
    path.write_text(json.dumps(COMPACT))
    return path


@pytest.mark.parametrize("ac_every", [0, 1])
def test_compiled_blocks_give_the_same_loss_and_gradients(ac_every: int) -> None:
    """Every block wrapped and compiled on its first call; a step's loss and gradients as
    eager's (fp32; the partitioned graphs recompute some ops, so within rounding)."""
    spec = resolve_model("tiny")
    batch = synthetic_batch(spec, 2, 64, seed=5)
    results = []
    for compiled in (False, True):
        config = TrainConfig(precision="fp32", ac_every=ac_every, torch_compile=compiled)
        module = build_model(spec, config)
        materialize(module, torch.device("cpu"), seed=0)
        wrapped = [isinstance(b, CompiledBlock) for b in decoder_blocks(module)]
        assert all(wrapped) is compiled
        loss = module(input_ids=batch, labels=batch).loss
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in module.parameters()]))
    (plain, plain_grads), (compiled_loss, grads) = results
    assert compiled_loss == pytest.approx(plain, rel=1e-6)
    for mine, theirs in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("knobs", "ranks"),
    # FSDP2 and the others measured once (docs/estimator.md).
    [({"precision": "fp32", "ac_every": 1}, 1), ({}, 1)],
    ids=["fp32-every-block", "bf16-mixed"],
)
def test_probe_saves_what_the_estimator_predicts(
    run_probe: RunProbe, compact: Path, knobs: dict, ranks: int
) -> None:
    """The probe's counter with and without compiled blocks, at 2 and 4 sequences (the second
    size compiles again, for dynamic shapes): compiled peaks from 6 % under to 12 % over their
    estimate (a checkpointed block's backward is taken to hold the eager block's saved set, a
    bound: 1-4 % over here in fp32; FSDP2 was 1-4 % over on a 3-block shape without compiling
    too), and with no block checkpointed the saving predicted within 4 % of the eager peak.
    Measured once at 8: bf16-mixed 115.5 MB eager, 92.5 MB compiled (94.4 predicted); fp32,
    every block checkpointed, 80.7 MB compiled (81.8 predicted)."""
    spec = resolve_model(str(compact))
    sizes = (2, 4)
    measured = {}
    for compiled in (False, True):
        result = run_probe(
            TrainConfig(**knobs, torch_compile=compiled),
            name=f"compile-{compiled}",
            model=str(compact),
            seq_len=SEQ,
            micro_batch_sizes=sizes,
            num_processes=ranks,
            timed_steps=1,  # a peak: the second step holds the optimizer states
        )
        assert result.outcome is Outcome.OK, probe_failure_text(result)
        measured[compiled] = {s.micro_batch_size: s.peak_allocated_bytes for s in result.sizes}
    for mbs in sizes:
        predicted = {
            compiled: estimate_memory(
                spec,
                TrainConfig(**knobs, torch_compile=compiled),
                micro_batch_size=mbs,
                seq_len=SEQ,
                world_size=ranks,
                cuda_allocator=False,
            ).peak_bytes
            for compiled in (False, True)
        }
        print(
            f"{knobs} mbs {mbs}: eager {measured[False][mbs]:,} B (predicted "
            f"{predicted[False]:,}), compiled {measured[True][mbs]:,} B (predicted "
            f"{predicted[True]:,})"
        )
        error = predicted[True] / measured[True][mbs] - 1
        assert -0.06 <= error <= 0.12, error
        if not knobs.get("ac_every"):  # FSDP2's estimate is 1-4 % over without compiling
            saved = measured[False][mbs] - measured[True][mbs]
            assert saved > 0
            assert abs(predicted[False] - predicted[True] - saved) <= 0.04 * measured[False][mbs]


@pytest.mark.parametrize(
    ("knobs", "says"),
    [
        ({"engine": "deepspeed", "zero_stage": 2}, "not wired for DeepSpeed"),
        ({"ac_ops": True}, "op-level checkpointing is not modelled with compiled blocks"),
        ({"act_offload": True}, "saved-tensor hooks are not modelled with compiled blocks"),
        ({"lora_rank": 8}, "not modelled with LoRA"),
        ({"torch_compile": "maybe"}, "use true or false"),
    ],
)
def test_combinations_it_is_not_modelled_with_are_refused(knobs: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        TrainConfig(**{"torch_compile": True, **knobs})


@pytest.mark.parametrize(
    "config",
    [TrainConfig(ac_every=1), TrainConfig(precision="bf16", ac_every=2, lora_rank=8)],
    ids=["full", "lora"],
)
def test_only_a_compiled_block_is_recomputed_as_another_block_saves(config: TrainConfig) -> None:
    """A checkpointed block's backward holds what the block saves (LoRA's own set under LoRA);
    compiled, the eager block's saved set, which is more than the compiled block keeps."""
    from autotune.estimator.activations import activation_profile

    spec = resolve_model("tiny")
    profile = activation_profile(spec, config, SEQ)
    assert profile.layer_recomputed_per_token == profile.layer_saved_per_token
    if not config.is_lora:
        compiled = activation_profile(spec, TrainConfig(ac_every=1, torch_compile=True), SEQ)
        assert compiled.layer_recomputed_per_token == profile.layer_saved_per_token
        assert compiled.layer_saved_per_token < profile.layer_saved_per_token
