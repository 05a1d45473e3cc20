"""Tests for autotune.models: presets, analytic counts, FLOPs and synthetic batches."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, ViTConfig

from autotune.models import ModelSpec, preset_names, resolve_model, synthetic_batch


def _meta_model(spec: ModelSpec) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(spec.hf_config)


def _meta_counts(spec: ModelSpec) -> tuple[int, int, int]:
    """Total, lookup-table and decoder-block parameters of the real model on meta."""
    model = _meta_model(spec)
    total = sum(p.numel() for p in model.parameters())
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tables = {id(m.weight): m.weight.numel() for m in embeddings}
    layers = model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else None
    if layers is None:
        layers = model.transformer.h  # gpt2
    blocks = sum(p.numel() for p in layers.parameters())
    return total, sum(tables.values()), blocks


EXPECTED_PRESETS = {
    "llama-7b", "llama-13b", "llama-70b", "llama3-8b", "mistral-7b", "qwen2.5-1.5b", "qwen2.5-7b",
    "gpt2",
    "tiny", "tiny-gpt2", "tiny-qwen",
}  # fmt: skip


def test_preset_names() -> None:
    assert set(preset_names()) == EXPECTED_PRESETS


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_analytic_counts_match_meta_build(name: str) -> None:
    spec = resolve_model(name)
    total, embedding, blocks = _meta_counts(spec)
    assert spec.num_params == total
    assert spec.num_embedding_params == embedding
    assert spec.num_block_params == blocks
    assert spec.hf_config.use_cache is False


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("llama-7b", 6.74e9),
        ("llama-13b", 13.0e9),
        ("llama3-8b", 8.03e9),
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
    rope = getattr(llama3.hf_config, "rope_parameters", None) or {}
    assert rope.get("rope_theta", getattr(llama3.hf_config, "rope_theta", None)) == 500000.0
    gpt2 = resolve_model("gpt2")
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.head_dim) == (12, 768, 64)
    assert gpt2.num_key_value_heads == 12  # no GQA: one kv head per query head
    assert gpt2.intermediate_size == 4 * 768
    assert gpt2.max_position_embeddings == 1024
    assert resolve_model("qwen2.5-1.5b").tie_word_embeddings
    assert not resolve_model("qwen2.5-7b").tie_word_embeddings
    assert resolve_model("mistral-7b").hf_config.sliding_window is None


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
    assert message.startswith("unknown model 'llama-9000': use one of llama-7b, ")
    assert "tiny-qwen" in message and "config.json" in message and "\n" not in message


def test_resolve_config_json_folder_and_file(tmp_path: Path) -> None:
    folder = tmp_path / "my-llama"
    config = resolve_model("tiny").hf_config
    config.use_cache = True
    config.save_pretrained(folder)
    for target in (folder, folder / "config.json"):
        spec = resolve_model(str(target))
        assert spec.name == "my-llama"
        assert spec.hf_config.use_cache is False
        assert spec.num_params == resolve_model("tiny").num_params


def test_resolve_other_causal_lm_counts_by_meta_build(tmp_path: Path) -> None:
    # qwen3 (q/k norms per head) is not an analytic family: counted on the meta device instead.
    Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    ).save_pretrained(tmp_path / "q3")  # fmt: skip
    spec = resolve_model(str(tmp_path / "q3"))
    assert spec.head_dim == 32
    assert (spec.num_params, spec.num_embedding_params, spec.num_block_params) == _meta_counts(spec)


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


def test_spec_is_frozen_and_compares_by_name() -> None:
    spec = resolve_model("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]
    assert spec == resolve_model("tiny")
    assert hash(spec) == hash(resolve_model("tiny"))


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
    model = AutoModelForCausalLM.from_config(spec.hf_config)
    batch = synthetic_batch(spec, 2, 32)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    # Random init predicts roughly uniformly over the vocabulary: loss near ln(256).
    assert abs(loss.item() - math.log(256)) < 1.0
