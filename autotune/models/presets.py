"""Named model shapes, and :func:`resolve_model`, which turns a name or a path into a spec.

A preset is the ``config.json`` fields of a published checkpoint, as plain data: fields its
family's config class fills in by default (``tie_word_embeddings``, ``head_dim``...) are left
out, as in a saved ``config.json``. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from autotune.models.config_file import load_config
from autotune.models.spec import ModelSpec

__all__ = ["preset_names", "resolve_model"]

# Shapes from each checkpoint's config.json on the Hugging Face Hub (meta-llama/Llama-2-7b-hf,
# -13b-hf and -70b-hf, Meta-Llama-3-8B and -70B, Llama-3.1-8B and -405B,
# mistralai/Mistral-7B-v0.3, Qwen/Qwen2.5-1.5B and -7B, openai-community/gpt2). rope_theta
# and rope_scaling are written as those files write them: transformers 4.x reads them as is,
# 5.x folds them into rope_parameters. No preset sets use_cache: the probes turn the KV cache
# off whatever the fields say.

# Test shapes: a few kB of weights, still with GQA (4 query heads sharing 2 kv heads).
_TINY: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip

_LLAMA31_ROPE: dict[str, Any] = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}  # fmt: skip

_PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    },
    "llama-13b": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 5120,
        "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 40, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    },
    "llama-70b": {
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    },
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama3-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # Llama 3.1: 128k positions through llama3 rope scaling of the 8k-trained frequencies.
    "llama3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "llama3.1-405b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 16384,
        "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128,
        "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE, "rms_norm_eps": 1e-5, "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    # v0.2 onward dropped the 4096-token sliding window of v0.1 and raised rope_theta to 1e6.
    "mistral-7b": {
        "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": None,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
        "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "gpt2": {
        "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
        "n_layer": 12, "n_head": 12,
    },
    "tiny": {"model_type": "llama", **_TINY},
    "tiny-gpt2": {
        "model_type": "gpt2", "vocab_size": 256, "n_positions": 512, "n_embd": 64, "n_layer": 2,
        "n_head": 4, "bos_token_id": 255, "eos_token_id": 255,
    },
    # Tied like the small Qwen2.5 models, so tests cover the tied-head and qkv-bias paths.
    "tiny-qwen": {
        "model_type": "qwen2", **_TINY, "tie_word_embeddings": True, "use_sliding_window": False,
    },
}  # fmt: skip


def preset_names() -> list[str]:
    """Names accepted by :func:`resolve_model` besides config paths."""
    return list(_PRESETS)


def resolve_model(name_or_path: str) -> ModelSpec:
    """Turn a preset name or a path to a Hugging Face ``config.json`` into a :class:`ModelSpec`.

    Args:
        name_or_path: A name from :func:`preset_names`, a ``config.json`` file, or a folder that
            holds one.  Hub ids are not fetched: this tool runs on offline training nodes.

    Returns:
        The spec; for a path, named after the folder holding the config.

    Raises:
        ValueError: For an unknown name, or a config that cannot be loaded as a causal LM.
    """
    if name_or_path in _PRESETS:
        return ModelSpec(name=name_or_path, config=_PRESETS[name_or_path])
    if not name_or_path.strip():
        raise ValueError(
            f"the model name is empty: use one of {', '.join(_PRESETS)}, or a path to a config.json"
        )
    path = Path(name_or_path).expanduser()
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
        has_config = is_dir and (path / "config.json").is_file()
    except OSError:  # a name too long for a path, say: no file, so a name
        is_file = is_dir = has_config = False
    if is_file or has_config:
        return load_config(path)
    if is_dir:
        raise ValueError(
            f"{name_or_path!r} holds no config.json: pass the folder of a Hugging Face model "
            "(its config.json is enough) or the file itself"
        )
    shown = name_or_path if len(name_or_path) <= 80 else name_or_path[:77] + "..."
    near = difflib.get_close_matches(name_or_path.lower(), _PRESETS, n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    raise ValueError(
        f"unknown model {shown!r}: {hint}use one of {', '.join(_PRESETS)}, "
        "or a path to a config.json"
    )
