"""Tests for reading Hugging Face config.json files without transformers, checked against it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from model_numbers import meta_counts, spec_numbers, transformers_numbers
from transformers import AutoConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from autotune.models import resolve_model

# Small shapes of every analytic family, with the options that change the count: explicit
# head_dim, GQA, biases, tying, gpt2's MLP width. Fields left out take the class defaults
# (vocabularies of 32000-151936 rows: fine on the meta device).
_SMALL: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
SAVED_CONFIGS: dict[str, Any] = {
    "llama": lambda: LlamaConfig(**_SMALL, num_attention_heads=4),
    "llama-gqa-biases-tied": lambda: LlamaConfig(
        **_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True, vocab_size=300,
    ),
    "mistral": lambda: MistralConfig(**_SMALL, num_attention_heads=8),
    "mistral-head-dim": lambda: MistralConfig(
        **_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None,
    ),
    "qwen2": lambda: Qwen2Config(**_SMALL, num_attention_heads=4, num_key_value_heads=2),
    "qwen2-tied-sliding": lambda: Qwen2Config(
        **_SMALL, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
        use_sliding_window=True, max_window_layers=1, max_position_embeddings=4096,
    ),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4),
    "gpt2-untied-inner": lambda: GPT2Config(
        n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=256, vocab_size=300,
        tie_word_embeddings=False, activation_function="relu",
    ),
}  # fmt: skip

# The fewest fields a config.json can have: everything else is the family's default.
MINIMAL_FILES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2},
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2},
    "qwen2": {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 512},
    "gpt2": {"model_type": "gpt2", "n_layer": 2},
    # The common names that GPT2Config maps onto its own; they win over gpt2's spelling.
    "gpt2-common-names": {
        "model_type": "gpt2", "hidden_size": 128, "n_embd": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256,
    },
}  # fmt: skip


def _assert_reads_like_transformers(folder: Path) -> None:
    spec = resolve_model(str(folder))
    reference = AutoConfig.from_pretrained(str(folder))
    assert spec_numbers(spec) == transformers_numbers(reference)
    counts = (spec.num_params, spec.num_embedding_params, spec.num_block_params)
    assert counts == meta_counts(spec)


@pytest.mark.parametrize("variant", sorted(SAVED_CONFIGS))
def test_saved_config_reads_like_transformers(variant: str, tmp_path: Path) -> None:
    SAVED_CONFIGS[variant]().save_pretrained(tmp_path)
    _assert_reads_like_transformers(tmp_path)


@pytest.mark.parametrize("variant", sorted(MINIMAL_FILES))
def test_minimal_config_takes_the_family_defaults(variant: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL_FILES[variant]))
    _assert_reads_like_transformers(tmp_path)


def test_models_and_estimator_import_neither_torch_nor_transformers(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL_FILES["qwen2"]))
    code = textwrap.dedent(
        f"""
        import sys
        import autotune.models, autotune.estimator.memory, autotune.estimator.timing
        import autotune.estimator.plan, autotune.estimator.activations
        from autotune.models import resolve_model
        assert resolve_model("llama-7b").num_params == 6_738_415_616
        assert resolve_model("gpt2").num_params == 124_439_808
        assert resolve_model({str(tmp_path)!r}).num_layers == 2
        loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not loaded, loaded
        """
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[1, 2]", "expected a JSON object, found list"),
        ('{"hidden_size": 64}', "no model_type field"),
        ('{"model_type": "no-such-model"}', "transformers knows no model_type 'no-such-model'"),
        ('{"model_type": "llama", "hidden_size": "64"}', "hidden_size must be a whole number"),
        ('{"model_type": "gpt2", "n_head": 0}', "num_attention_heads must be a whole number"),
        ('{"model_type": "qwen2", "tie_word_embeddings": 1}', "tie_word_embeddings must be"),
        ('{"model_type": "qwen3", "hidden_size": "64"}', "hidden_size"),
    ],
)
def test_malformed_config_is_one_line(text: str, says: str, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError) as info:
        resolve_model(str(tmp_path))
    message = str(info.value)
    assert message.startswith(f"cannot load model config from '{tmp_path}': ")
    assert says in message and "\n" not in message
