"""Tests for autotune.models: presets, analytic counts, FLOPs, and the probe side's transformers
configs and synthetic batches built from them."""

from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from model_numbers import meta_counts, meta_model, spec_numbers, transformers_numbers
from transformers import AutoModelForCausalLM, Qwen3Config, ViTConfig

from autotune.models import ModelSpec, preset_names, resolve_model
from autotune.probe.data import synthetic_batch
from autotune.probe.modeling import hf_config

EXPECTED_PRESETS = {
    "llama-7b", "llama-13b", "llama-70b", "llama3-8b", "llama3-70b", "llama3.1-8b",
    "llama3.1-405b", "mistral-7b", "qwen2.5-1.5b", "qwen2.5-7b", "gpt2",
    "tiny", "tiny-gpt2", "tiny-qwen",
}  # fmt: skip


def test_preset_names() -> None:
    assert set(preset_names()) == EXPECTED_PRESETS


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_analytic_counts_match_meta_build(name: str) -> None:
    spec = resolve_model(name)
    total, embedding, blocks = meta_counts(spec)
    assert spec.num_params == total
    assert spec.num_embedding_params == embedding
    assert spec.num_block_params == blocks
    sizes = collections.Counter(p.numel() for p in meta_model(spec).parameters())
    assert spec.parameter_tensors == tuple(sorted(sizes.items()))
    # The linear layers of a block, as peft's "all-linear" finds them (LoRA's adapters).
    from autotune.models.families import _linears

    first = next(m for m in meta_model(spec).modules() if type(m).__name__.endswith("Layer")
                 or type(m).__name__ == "GPT2Block")  # fmt: skip
    assert spec.block_linears == _linears(first)


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_numbers_equal_the_probe_side_transformers_config(name: str) -> None:
    spec = resolve_model(name)
    config = hf_config(spec)
    assert spec_numbers(spec) == transformers_numbers(config)
    assert config.use_cache is False
    assert spec.activation == (
        config.activation_function if spec.model_type == "gpt2" else config.hidden_act
    )


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-7b", 6.74e9),
        ("llama-13b", 13.0e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
        ("llama3.1-8b", 8.03e9),
        ("llama3.1-405b", 405.9e9),
        ("mistral-7b", 7.24e9),
        ("qwen2.5-1.5b", 1.54e9),
        ("qwen2.5-7b", 7.61e9),
        ("gpt2", 124e6),
    ],
)
def test_published_parameter_counts(name: str, published: float) -> None:
    assert resolve_model(name).num_params == pytest.approx(published, rel=0.005)


def test_exact_known_counts() -> None:
    # Values printed by the model cards / `model.num_parameters()` of the real checkpoints.
    assert resolve_model("llama-7b").num_params == 6_738_415_616
    assert resolve_model("llama3-8b").num_params == 8_030_261_248
    assert resolve_model("llama-70b").num_params == 68_976_648_192
    assert resolve_model("gpt2").num_params == 124_439_808


def test_derived_shape_properties() -> None:
    llama3 = resolve_model("llama3-8b")
    assert (llama3.num_layers, llama3.hidden_size, llama3.num_attention_heads) == (32, 4096, 32)
    assert (llama3.num_key_value_heads, llama3.head_dim) == (8, 128)
    assert (llama3.intermediate_size, llama3.vocab_size) == (14336, 128256)
    assert llama3.max_position_embeddings == 8192
    config = hf_config(llama3)
    rope = getattr(config, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(config, "rope_theta", None)) == 500000.0
    gpt2 = resolve_model("gpt2")
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.head_dim) == (12, 768, 64)
    assert gpt2.num_key_value_heads == 12  # no GQA: one kv head per query head
    assert gpt2.intermediate_size == 4 * 768
    assert gpt2.max_position_embeddings == 1024
    assert resolve_model("qwen2.5-1.5b").tie_word_embeddings
    assert not resolve_model("qwen2.5-7b").tie_word_embeddings
    assert hf_config(resolve_model("mistral-7b")).sliding_window is None
    assert (gpt2.activation, llama3.activation) == ("gelu_new", "silu")


def test_embedding_params_include_learned_positions() -> None:
    gpt2 = resolve_model("gpt2")
    assert gpt2.num_embedding_params == 50257 * 768 + 1024 * 768
    # Tied head: the shared table still does the lm_head matmul, so only wpe drops out.
    assert gpt2.num_matmul_params == gpt2.num_params - 1024 * 768
    llama = resolve_model("llama-7b")
    assert llama.num_matmul_params == llama.num_params - 32000 * 4096


def test_flops_worked_example_llama_7b() -> None:
    spec = resolve_model("llama-7b")
    n_matmul = 6_738_415_616 - 32000 * 4096
    attention = 12 * 32 * 32 * 128 * 2048
    assert spec.flops_per_token(2048) == 6 * n_matmul + attention == 42_865_287_168


def test_flops_worked_example_tiny() -> None:
    spec = resolve_model("tiny")  # L=2, H=4, Q=16, untied, 106816 params, 256x64 table
    assert spec.flops_per_token(128) == 6 * (106816 - 16384) + 12 * 2 * 4 * 16 * 128
    # Full recompute adds one forward of the blocks: 2·N_block + 4·L·H·Q·T.
    extra = 2 * spec.num_block_params + 4 * 2 * 4 * 16 * 128
    assert spec.flops_per_token(128, recompute=True) == spec.flops_per_token(128) + extra


@pytest.mark.parametrize("name", ["llama-7b", "qwen2.5-1.5b", "gpt2"])
def test_hardware_flops_fraction(name: str) -> None:
    spec = resolve_model(name)
    model = spec.flops_per_token(4096 if name != "gpt2" else 1024)
    seq = 4096 if name != "gpt2" else 1024
    full = spec.hardware_flops_per_token(seq, 1.0)
    assert spec.hardware_flops_per_token(seq, 0.0) == model
    assert spec.hardware_flops_per_token(seq, 0.5) == pytest.approx((model + full) / 2)
    assert full == spec.flops_per_token(seq, recompute=True)
    # Close to the textbook 8/6 ratio; below it because the lm_head is not recomputed.
    assert 1.2 < full / model < 4 / 3


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_hardware_flops_rejects_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="checkpointed_fraction"):
        resolve_model("tiny").hardware_flops_per_token(16, fraction)


def test_flops_grow_with_sequence_length() -> None:
    spec = resolve_model("llama3-8b")
    assert spec.flops_per_token(8192) - spec.flops_per_token(4096) == 12 * 32 * 32 * 128 * 4096


def test_unknown_model_message() -> None:
    with pytest.raises(ValueError) as info:
        resolve_model("llama-9000")
    message = str(info.value)
    assert message.startswith(
        "unknown model 'llama-9000': did you mean llama-70b or llama3-70b or llama-7b"
    )
    assert "use one of llama-7b, " in message
    assert "tiny-qwen" in message and "config.json" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"^unknown model 'zzz': use one of") as info:
        resolve_model("zzz")  # nothing near: no guess


def test_resolve_config_json_folder_and_file(tmp_path: Path) -> None:
    folder = tmp_path / "my-llama"
    config = hf_config(resolve_model("tiny"))
    config.use_cache = True
    config.save_pretrained(folder)
    for target in (folder, folder / "config.json"):
        spec = resolve_model(str(target))
        assert spec.name == "my-llama"
        assert spec.config["use_cache"] is True  # the file's fields, as written
        assert hf_config(spec).use_cache is False  # but probes never keep a KV cache
        assert spec.num_params == resolve_model("tiny").num_params


def test_resolve_other_causal_lm_counts_by_meta_build(tmp_path: Path) -> None:
    # qwen3 (q/k norms per head) is not an analytic family: counted on the meta device instead.
    Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    ).save_pretrained(tmp_path / "q3")  # fmt: skip
    spec = resolve_model(str(tmp_path / "q3"))
    assert spec.head_dim == 32
    assert (spec.num_params, spec.num_embedding_params, spec.num_block_params) == meta_counts(spec)


def test_resolve_rejects_non_causal_and_broken_configs(tmp_path: Path) -> None:
    ViTConfig().save_pretrained(tmp_path / "vit")
    with pytest.raises(ValueError, match="not a causal LM"):
        resolve_model(str(tmp_path / "vit"))
    broken = tmp_path / "broken" / "config.json"
    broken.parent.mkdir()
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load model config"):
        resolve_model(str(broken))
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model(str(tmp_path / "empty-dir-without-config"))


def test_spec_is_frozen_and_compares_by_value() -> None:
    spec = resolve_model("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.config["hidden_size"] = 128  # type: ignore[index]
    assert spec == resolve_model("tiny")
    assert hash(spec) == hash(resolve_model("tiny"))
    assert spec.with_layers(3) != spec  # same name, other fields
    assert spec.with_layers(2) == spec


def test_spec_keeps_a_private_copy_of_its_fields() -> None:
    layer_types = ["full_attention"]
    fields = {"model_type": "llama", "hidden_size": 64, "layer_types": layer_types}
    spec = ModelSpec(name="mine", config=fields)
    fields["hidden_size"] = 128
    layer_types.append("sliding_attention")
    assert spec.config["hidden_size"] == 64 and spec.config["layer_types"] == ["full_attention"]
    copied = spec.config_dict()
    copied["layer_types"].append("x")
    assert spec.config["layer_types"] == ["full_attention"]
    with pytest.raises(ValueError, match="no model_type"):
        ModelSpec(name="typeless", config={"hidden_size": 64})


@pytest.mark.parametrize("name", ["llama-70b", "qwen2.5-1.5b", "gpt2", "tiny-gpt2"])
def test_with_layers_changes_only_the_depth(name: str) -> None:
    spec = resolve_model(name)
    shallow = spec.with_layers(3)
    assert shallow.name == spec.name and shallow.num_layers == 3
    assert hf_config(shallow).num_hidden_layers == 3
    assert spec_numbers(shallow) == {**spec_numbers(spec), "num_layers": 3}
    assert shallow.num_block_params * spec.num_layers == spec.num_block_params * 3
    assert shallow.num_params == meta_counts(shallow)[0]
    with pytest.raises(ValueError, match="layers 0 must be >= 1"):
        spec.with_layers(0)


def test_with_layers_repeats_per_layer_types(tmp_path: Path) -> None:
    # A saved qwen2 config lists one attention type per layer: the list follows the depth.
    config = hf_config(resolve_model("tiny-qwen"))
    config.layer_types = ["full_attention", "sliding_attention"]
    config.save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    deep = spec.with_layers(5)
    assert deep.config["layer_types"] == ["full_attention", "sliding_attention"] * 2 + [
        "full_attention"
    ]
    assert hf_config(deep).layer_types == list(deep.config["layer_types"])


def test_synthetic_batch_shape_and_determinism() -> None:
    spec = resolve_model("tiny")
    batch = synthetic_batch(spec, 3, 64, seed=7)
    assert batch.shape == (3, 64) and batch.dtype == torch.int64
    assert batch.device.type == "cpu"
    assert int(batch.min()) >= 0 and int(batch.max()) < spec.vocab_size
    assert torch.equal(batch, synthetic_batch(spec, 3, 64, seed=7))
    assert not torch.equal(batch, synthetic_batch(spec, 3, 64, seed=8))


def test_synthetic_batch_rejects_too_long_sequences() -> None:
    spec = resolve_model("tiny")
    with pytest.raises(ValueError, match="seq_len 513 exceeds the 512 positions"):
        synthetic_batch(spec, 1, 513)
    with pytest.raises(ValueError, match="micro_batch_size 0 and seq_len 16 must be >= 1"):
        synthetic_batch(spec, 0, 16)


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2", "tiny-qwen"])
def test_tiny_presets_train_on_cpu(name: str) -> None:
    spec = resolve_model(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(spec))
    batch = synthetic_batch(spec, 2, 32)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    # Random init predicts roughly uniformly over the vocabulary: loss near ln(256).
    assert abs(loss.item() - math.log(256)) < 1.0
